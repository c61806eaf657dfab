"""The OpenAI wire to an upstream: a ``GenerationRequest`` as a streamed ``/v1/completions``
or ``/v1/chat/completions`` body, and the upstream's SSE chunks back as text, logprobs and
usage.

Logprobs travel as token strings (``token_id:N`` when the upstream honours vLLM's
``return_tokens_as_token_ids``); ``TokenIds`` maps them back to the ids the front doors
render, through the gateway's own tokenizer, so fleet logprobs need ``--tokenizer``."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import orjson

from engine import SamplingParams
from engine.tokenizer import Tokenizer
from gateway.generation import GenerationRequest

_DEFAULTS = SamplingParams()
_SAMPLING = tuple(f.name for f in fields(SamplingParams) if f.name != "logprobs")


def request_body(request: GenerationRequest, model: str) -> tuple[str, dict[str, Any]]:
    """The upstream path and body. Sampling fields at their defaults are left out, so the
    upstream's own generation_config defaults apply as they would to a direct call."""
    params = request.params
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": params.max_tokens,
    }
    for name in _SAMPLING:
        value = getattr(params, name)
        if value != getattr(_DEFAULTS, name):
            body[name] = value
    if request.cache_key is not None:
        body["cache_key"] = request.cache_key  # kvgate routes its replicas on it
    if request.cache_salt is not None:
        body["cache_salt"] = request.cache_salt  # vLLM and kvgate: tenant isolation
    top = params.logprobs
    if top is not None:
        body["return_tokens_as_token_ids"] = True  # vLLM: exact ids; others send strings
    if request.messages is None:
        if top is not None:
            body["logprobs"] = top
        return "/v1/completions", {**body, "prompt": request.prompt}
    if top is not None:
        body["logprobs"], body["top_logprobs"] = True, top
    body["messages"] = request.messages
    if request.tools is not None:
        body["tools"] = request.tools
    if request.chat_template_kwargs is not None:
        body["chat_template_kwargs"] = request.chat_template_kwargs
    return "/v1/chat/completions", body


class StreamError(Exception):
    """The upstream said, inside its stream, that the generation failed."""


# One generated token's logprob entry as the upstream wrote it: (token, logprob, the top
# alternatives as (token, logprob) in the upstream's order).
TokenLogprob = tuple[str, float, list[tuple[str, float]]]


@dataclass
class Chunk:
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    done: bool = False  # the [DONE] line
    logprobs: list[TokenLogprob] = field(default_factory=list)


def parse_line(line: str) -> Chunk | None:
    """One SSE line: a chunk, or None for anything that carries none (blank, comments)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return Chunk(done=True)
    chunk = orjson.loads(data)
    if "error" in chunk:
        error = chunk["error"]
        raise StreamError(error.get("message", str(error)) if isinstance(error, dict) else error)
    out = Chunk(usage=chunk.get("usage"))
    for choice in chunk.get("choices") or ():
        if "delta" in choice:
            out.text += choice["delta"].get("content") or ""
        else:
            out.text += choice.get("text") or ""
        out.finish_reason = choice.get("finish_reason") or out.finish_reason
        out.logprobs += _logprobs(choice.get("logprobs"))
    return out


def _logprobs(raw: Any) -> list[TokenLogprob]:
    """A choice's ``logprobs``: chat's ``{"content": [...]}`` or completions' parallel lists."""
    if not isinstance(raw, dict):
        return []
    try:
        if "content" in raw:
            return [
                (
                    str(e["token"]),
                    float(e["logprob"]),
                    [(str(t["token"]), float(t["logprob"])) for t in e["top_logprobs"]],
                )
                for e in raw["content"] or ()
            ]
        tops = raw.get("top_logprobs") or [{}] * len(raw["tokens"])
        return [
            (str(token), float(logprob), [(str(t), float(lp)) for t, lp in (top or {}).items()])
            for token, logprob, top in zip(raw["tokens"], raw["token_logprobs"], tops, strict=True)
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise StreamError(f"malformed logprobs from the upstream: {exc}") from None


class TokenIds:
    """Upstream token strings → token ids of the gateway's tokenizer: ``token_id:N`` as is,
    else the id whose text is that string (the front door renders an id by decoding it, so
    the string shown is the upstream's even where several ids share it)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: dict[str, int] | None = None

    def prepare(self) -> None:
        """Decode the vocabulary once (about a second for 150k ids: the fleet runs it on a
        worker thread at startup, so no stream waits for it)."""
        if self._ids is None:
            ids: dict[str, int] = {}
            for i in range(self._tokenizer.vocab_size):
                ids.setdefault(self._tokenizer.decode([i], skip_special_tokens=False), i)
            self._ids = ids

    def __call__(self, token: str) -> int:
        if token.startswith("token_id:") and token[9:].isdigit():
            return int(token[9:])
        self.prepare()
        assert self._ids is not None
        found = self._ids.get(token)
        if found is None:  # not one token's text (a tokenizer unlike the upstream's)
            encoded = self._tokenizer.encode(token, add_special_tokens=False)
            found = encoded[0] if encoded else 0
        return found

    def entries(self, logprobs: list[TokenLogprob]) -> tuple[list[int], list[dict[int, float]]]:
        """Token ids and ``{id: logprob}`` entries (the top ones first, then the chosen one),
        as the embedded engine yields them."""
        ids, entries = [], []
        for token, logprob, tops in logprobs:
            chosen = self(token)
            entry = {self(t): lp for t, lp in tops}
            entry.setdefault(chosen, logprob)
            ids.append(chosen)
            entries.append(entry)
        return ids, entries


def cached_tokens(usage: dict[str, Any]) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` (vLLM leaves it null unless asked)."""
    details = usage.get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)
