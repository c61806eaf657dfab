"""The OpenAI wire to an upstream: a ``GenerationRequest`` as a streamed ``/v1/completions``
or ``/v1/chat/completions`` body, and the upstream's SSE chunks back as text and usage."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import orjson

from engine import SamplingParams
from gateway.generation import GenerationRequest

_DEFAULTS = SamplingParams()
_SAMPLING = tuple(f.name for f in fields(SamplingParams) if f.name != "logprobs")


def request_body(request: GenerationRequest, model: str) -> tuple[str, dict[str, Any]]:
    """The upstream path and body. Sampling fields at their defaults are left out, so the
    upstream's own generation_config defaults apply as they would to a direct call."""
    if request.params.logprobs is not None:
        raise ValueError("logprobs: not served in fleet mode yet")
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
    if request.messages is None:
        return "/v1/completions", {**body, "prompt": request.prompt}
    body["messages"] = request.messages
    if request.tools is not None:
        body["tools"] = request.tools
    if request.chat_template_kwargs is not None:
        body["chat_template_kwargs"] = request.chat_template_kwargs
    return "/v1/chat/completions", body


class StreamError(Exception):
    """The upstream said, inside its stream, that the generation failed."""


@dataclass
class Chunk:
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    done: bool = False  # the [DONE] line


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
    return out


def cached_tokens(usage: dict[str, Any]) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` (vLLM leaves it null unless asked)."""
    details = usage.get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)
