"""OpenAI request bodies → ``GenerationRequest``s, checked the way vLLM's server checks them.

Known fields of the wrong type or out of range are a 400 naming the field (never a 500);
unknown fields are ignored, as OpenAI clients send many. Structured outputs are served
(``response_format`` json_object / json_schema, and vLLM's ``structured_outputs`` extras:
json, regex, choice, grammar); ``logit_bias`` as vLLM reads it (token id strings, [-100, 100],
added to the logits before temperature); ``max_tokens`` that cannot fit after the prompt is a
400 (below, where the prompt is counted); the chat route's ``tools`` / ``tool_choice`` /
``parallel_tool_calls`` become the request's ``Functions`` (on ``/v1/completions`` they are a
400; the calls are read below the doors, ``kvgate.gateway.function_calls.reading``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.engine.sampling_params import MAX_LOGIT_BIAS, StructuredOutputs
from kvgate.gateway.calls.errors import BadInput, NotFound
from kvgate.gateway.function_calls.functions import Functions
from kvgate.gateway.generation import Adapter

MAX_N = 16
MAX_TOP_LOGPROBS = 20
ROLES = frozenset(("system", "developer", "user", "assistant", "tool"))
CHAT_ONLY = ("tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")
RESPONSE_FORMATS = ("text", "json_object", "json_schema")
DEPRECATED = ("functions", "function_call")

_NUMBER = (int, float)


@dataclass(frozen=True)
class Sampling:
    """What both routes share: the sampling fields, n, streaming and the cache extras."""

    fields: dict[str, Any]  # SamplingParams keyword arguments
    n: int
    stream: bool
    include_usage: bool
    cache_key: str | None
    cache_salt: str | None


def _get(body: dict[str, Any], name: str, types: tuple[type, ...], what: str) -> Any:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in types:
        raise BadInput(f"'{name}' must be {what}, got a boolean", name)
    if not isinstance(value, types):
        raise BadInput(f"'{name}' must be {what}, got {type(value).__name__}", name)
    return value


def _in_range(name: str, value: Any, low: float, high: float, what: str) -> None:
    if value is not None and not low <= value <= high:
        raise BadInput(f"'{name}' must be {what}, got {value}", name)


def _integer(body: dict[str, Any], name: str) -> int | None:
    """An integer, or a float with no fraction (JSON Schema 2020-12 calls 8.0 an integer)."""
    value = _get(body, name, _NUMBER, "an integer")
    if isinstance(value, float):
        if not value.is_integer():
            raise BadInput(f"'{name}' must be an integer, got {value}", name)
        value = int(value)
    return value if value is None else int(value)


def sampling(body: dict[str, Any], *, chat: bool) -> Sampling:
    for name in () if chat else CHAT_ONLY:
        if body.get(name) is not None:
            raise BadInput(f"'{name}' is only for /v1/chat/completions", name)
    fields: dict[str, Any] = {}
    max_tokens = _integer(body, "max_completion_tokens" if chat else "max_tokens")
    if max_tokens is None and chat:
        max_tokens = _integer(body, "max_tokens")
    if max_tokens is not None:
        _in_range("max_tokens", max_tokens, 1, float("inf"), ">= 1")
        fields["max_tokens"] = max_tokens
    for name, low, high, what in (
        ("temperature", 0, 2, "between 0 and 2"),
        ("top_p", 1e-9, 1, "in (0, 1]"),
        ("presence_penalty", -2, 2, "between -2 and 2"),
        ("frequency_penalty", -2, 2, "between -2 and 2"),
        ("repetition_penalty", 1e-9, float("inf"), "> 0"),
    ):
        value = _get(body, name, _NUMBER, "a number")
        _in_range(name, value, low, high, what)
        if value is not None:
            fields[name] = float(value)
    top_k = _integer(body, "top_k")
    if top_k is not None:
        _in_range("top_k", top_k, -1, float("inf"), "-1 (off) or >= 0")
        fields["top_k"] = max(top_k, 0)
    min_tokens = _integer(body, "min_tokens")
    if min_tokens is not None:
        _in_range("min_tokens", min_tokens, 0, float("inf"), ">= 0")
        fields["min_tokens"] = min_tokens
    seed = _integer(body, "seed")
    if seed is not None:
        _in_range("seed", seed, 0, 2**64 - 1, "in [0, 2**64 - 1]")
        fields["seed"] = seed
    for flag in ("ignore_eos", "skip_special_tokens"):
        if (value := _get(body, flag, (bool,), "a boolean")) is not None:
            fields[flag] = value
    stop = body.get("stop")
    if isinstance(stop, str) and stop:
        fields["stop"] = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
        fields["stop"] = stop
    elif stop is not None:
        raise BadInput("'stop' must be a string or a list of non-empty strings", "stop")
    fields.update(_logprobs(body, chat))
    logit_bias = _logit_bias(body)
    if logit_bias is not None:
        fields["logit_bias"] = logit_bias
    structured = _structured_outputs(body)
    if structured is not None:
        fields["structured_outputs"] = structured
    n = _integer(body, "n")
    n = 1 if n is None else n
    _in_range("n", n, 1, MAX_N, f"between 1 and {MAX_N}")
    stream = bool(_get(body, "stream", (bool,), "a boolean"))
    options = _get(body, "stream_options", (dict,), "an object")
    if options is not None and not stream:
        raise BadInput("'stream_options' is only allowed with 'stream': true", "stream_options")
    include_usage = bool(options and _get(options, "include_usage", (bool,), "a boolean"))
    _get(body, "user", (str,), "a string")
    return Sampling(
        fields,
        n,
        stream,
        include_usage,
        _get(body, "cache_key", (str,), "a string"),
        _get(body, "cache_salt", (str,), "a string"),
    )


def _logit_bias(body: dict[str, Any]) -> dict[int, float] | None:
    """``logit_bias``: token ids (JSON object keys, so strings of digits) to a bias in
    [-100, 100] added to that token's logit (ids beyond the vocabulary: the engine refuses)."""
    bias = _get(body, "logit_bias", (dict,), "an object mapping token ids to biases")
    if bias is None:
        return None
    parsed: dict[int, float] = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise BadInput(f"'logit_bias' keys must be token ids, got {key[:40]!r}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, _NUMBER):
            raise BadInput(f"'logit_bias[{key}]' must be a number", "logit_bias")
        bound = MAX_LOGIT_BIAS
        if not -bound <= value <= bound:  # also NaN
            raise BadInput(
                f"'logit_bias[{key}]' must be between {-bound:g} and {bound:g}, got {value}",
                "logit_bias",
            )
        parsed[int(key)] = float(value)
    return parsed


def _structured_outputs(body: dict[str, Any]) -> StructuredOutputs | None:
    """``response_format`` (OpenAI) or ``structured_outputs`` (vLLM), at most one of them.
    The schema itself is compiled (and refused, naming it) when the request is admitted."""
    extras = _get(body, "structured_outputs", (dict,), "an object")
    response_format = _get(body, "response_format", (dict,), "an object")
    fields: dict[str, Any] | None = None
    if response_format is not None:
        kind = response_format.get("type")
        if kind not in RESPONSE_FORMATS:
            raise BadInput(
                f"'response_format.type' must be one of {list(RESPONSE_FORMATS)}, got {kind!r}",
                "response_format.type",
            )
        if kind == "json_object":
            fields = {"json_object": True}
        elif kind == "json_schema":
            fields = {"json": _json_schema(response_format.get("json_schema"))}
    if extras is not None:
        if fields is not None:
            raise BadInput(
                "give either 'response_format' or 'structured_outputs', not both",
                "structured_outputs",
            )
        fields = extras
    if fields is None:
        return None
    try:
        return StructuredOutputs.from_dict(fields)
    except ValueError as exc:
        raise BadInput(str(exc), "structured_outputs" if extras else "response_format") from None


def _json_schema(spec: Any) -> dict[str, Any]:
    """``response_format.json_schema``: ``{name, description?, schema?, strict?}``. The schema
    is always enforced (``strict`` or not); a missing one allows any JSON object."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise BadInput(f"'{where}' must be an object", where)
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise BadInput(f"'{where}.name' must be a non-empty string", f"{where}.name")
    for key, types, what in (
        ("schema", (dict,), "an object"),
        ("strict", (bool,), "a boolean"),
        ("description", (str,), "a string"),
    ):
        _get(spec, key, types, what)
    schema = spec.get("schema")
    return {"type": "object"} if schema is None else schema


def _logprobs(body: dict[str, Any], chat: bool) -> dict[str, Any]:
    if chat:
        wanted = _get(body, "logprobs", (bool,), "a boolean")
        top = _integer(body, "top_logprobs")
        _in_range("top_logprobs", top, 0, MAX_TOP_LOGPROBS, f"between 0 and {MAX_TOP_LOGPROBS}")
        if top is not None and not wanted:
            raise BadInput("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return {"logprobs": top or 0} if wanted else {}
    top = _integer(body, "logprobs")
    _in_range("logprobs", top, 0, MAX_TOP_LOGPROBS, f"between 0 and {MAX_TOP_LOGPROBS}")
    return {} if top is None else {"logprobs": top}


def completion_prompts(body: dict[str, Any], name: str = "prompt") -> list[str | list[int]]:
    """``prompt`` (or the embeddings' ``input``): a string, a list of strings, token ids, or
    a list of token-id lists."""
    prompt = body.get(name)
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_token(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise BadInput(
        f"'{name}' must be a string, a list of strings, a list of token ids, or a list of "
        "token-id lists (none empty)",
        name,
    )


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``messages``: roles system/developer/user/assistant/tool; content a string, text parts
    or null (an assistant turn with tool calls). Text parts are joined into one string, as
    vLLM does for templates that read ``content`` as text."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadInput("'messages' must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise BadInput(f"'{where}' must be an object", where)
        if message.get("role") not in ROLES:
            raise BadInput(
                f"'{where}.role' must be one of {sorted(ROLES)}, got {message.get('role')!r}",
                f"{where}.role",
            )
        content = message.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text"):
                    raise BadInput(
                        f"'{where}.content[{j}]' must be a text part (this model reads text)",
                        f"{where}.content",
                    )
                if not isinstance(part.get("text"), str):
                    raise BadInput(
                        f"'{where}.content[{j}].text' must be a string", f"{where}.content"
                    )
            messages[i] = {**message, "content": "\n".join(part["text"] for part in content)}
        elif content is not None and not isinstance(content, str):
            raise BadInput(
                f"'{where}.content' must be a string, a list of text parts or null",
                f"{where}.content",
            )
    return messages


def check_model(
    body: dict[str, Any], served: str, adapters: list[Adapter] | None = None
) -> str | None:
    """The LoRA adapter ``model`` names (None: the served base model); 404 for a name not
    served. ``adapters`` None (a fleet): any other name is an adapter its upstream judges."""
    model = body.get("model")
    if model is None or model == served:
        return None
    if not isinstance(model, str):
        raise BadInput("'model' must be a string", "model")
    if adapters is None or any(a.name == model for a in adapters):
        return model
    raise NotFound(f"The model `{model}` does not exist (this server serves '{served}')", "model")


def chat_functions(body: dict[str, Any]) -> Functions | None:
    """The functions the model may call (None without ``tools``)."""
    for name in DEPRECATED:
        if body.get(name) is not None:
            raise BadInput(f"'{name}' is deprecated and not served: use 'tools'", name)
    return Functions.of(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"))
