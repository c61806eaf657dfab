"""vLLM's render answers (``/v1/chat/completions/render``, ``/v1/completions/render``,
``/v1/responses/render``): the prompt token ids a call would be prefilled with and the
sampling settings it would run with, as vLLM's ``GenerateRequest``
(``vllm/entrypoints/scale_out/render/``), without generating.

vllm-router's ``cache_aware`` policy asks a worker's render endpoint for every call it routes
(then ``/tokenize`` when a chat's or completion's render answers 404) and routes on the
``token_ids``; a chat or a response answers one object, a completion a list, one per prompt
(ids suffixed ``-0``, ``-1``… when the call has several). ``sampling_params`` carries vLLM's
names for what this server applies (the fields vLLM leaves out at their defaults left out
here too; none of vLLM's internal ones); ``max_tokens`` is the most this server would
generate: what was asked, within the context.
"""

from __future__ import annotations

import uuid
from typing import Any

from kvgate.engine.errors import InvalidArgument
from kvgate.engine.sampling_params import STRUCTURED_KINDS, SamplingParams
from kvgate.gateway.calls.errors import BadInput
from kvgate.gateway.generation import check_max_tokens

# The fields of vLLM's GenerateRequest a text-only render leaves empty (vLLM 0.32).
EMPTY = (
    "token_offsets",
    "features",
    "content_parts",
    "reasoning_ended",
    "reasoning_parser_kwargs",
    "return_token_ids",
)


def request_ids(prefix: str, prompts: int) -> list[str]:
    """vLLM's ids: ``prefix`` (``chatcmpl-``, ``cmpl-``, ``resp_``) and 16 hex digits,
    suffixed with the prompt's index when there are several."""
    base = f"{prefix}{uuid.uuid4().hex[:16]}"
    return [base] if prompts == 1 else [f"{base}-{i}" for i in range(prompts)]


def max_tokens(params: SamplingParams, prompt_tokens: int, context: int, prompt: str) -> int:
    """The most a call would generate after ``prompt_tokens``: its ``max_tokens`` within the
    context; a prompt that leaves no room, or a ``max_tokens`` the call itself would be
    refused for (``check_max_tokens``), is a 400 (``prompt`` names the prompt's field)."""
    if prompt_tokens >= context:
        raise BadInput(
            f"this model's context length is {context} tokens, and the prompt has "
            f"{prompt_tokens}: shorten it",
            prompt,
        )
    try:
        check_max_tokens(params, prompt_tokens, context)
    except InvalidArgument as exc:
        raise BadInput(str(exc), exc.field) from None
    return min(params.max_tokens, context - prompt_tokens)


def sampling_params(params: SamplingParams, n: int, most: int) -> dict[str, Any]:
    """``params`` in vLLM's ``SamplingParams`` names, at most ``most`` tokens."""
    fields: dict[str, Any] = {} if n == 1 else {"n": n}
    fields |= {
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "temperature": params.temperature,
        "top_p": params.top_p,
    }
    if params.top_k > 0:
        fields["top_k"] = params.top_k
    fields["min_p"] = 0.0
    if params.seed is not None:
        fields["seed"] = params.seed
    fields |= {"stop": list(params.stop), "stop_token_ids": list(params.stop_token_ids)}
    if params.ignore_eos:
        fields["ignore_eos"] = True
    fields["max_tokens"] = most
    if params.min_tokens:
        fields["min_tokens"] = params.min_tokens
    if params.logprobs is not None:
        fields["logprobs"] = params.logprobs
    if not params.skip_special_tokens:
        fields["skip_special_tokens"] = False
    if params.logit_bias:
        fields["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    spec = params.structured_outputs
    if spec is not None:
        fields["structured_outputs"] = {
            k: getattr(spec, k) for k in STRUCTURED_KINDS if getattr(spec, k) not in (None, False)
        }
    return fields


def generate_request(
    request_id: str,
    token_ids: list[int],
    sampling: dict[str, Any],
    model: str | None,
    stream: bool,
    stream_options: dict[str, Any] | None,
    cache_salt: str | None,
) -> dict[str, Any]:
    """One vLLM ``GenerateRequest``, every field vLLM writes in the order it writes them."""
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        **dict.fromkeys(EMPTY[:3]),
        "sampling_params": sampling,
        "model": model,
        **dict.fromkeys(EMPTY[3:]),
        "output_mode": "tokens",
        "stream": stream,
        "stream_options": stream_options if stream else None,
        "cache_salt": cache_salt,
        "priority": 0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }
