"""The OpenAI wire to an upstream: a ``GenerationRequest`` as a streamed ``/v1/completions``
or ``/v1/chat/completions`` body, and the upstream's SSE chunks back as text, logprobs,
tool calls and usage.

Tool calling is the upstream's: it knows its model's template and call syntax, so a chat's
``tools``, ``tool_choice`` and ``parallel_tool_calls`` go as the OpenAI fields (never as a
grammar), and its ``delta.tool_calls`` come back checked (they are outside data: a malformed
entry is a ``StreamError``) and added up into whole calls (``ToolCalls``).

Logprobs travel as token strings (``token_id:N`` when the upstream honours vLLM's
``return_tokens_as_token_ids``); ``TokenIds`` maps them back to the ids the front doors
render, through the gateway's own tokenizer, so fleet logprobs need ``--tokenizer``."""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from kvgate.engine import StructuredOutputs
from kvgate.engine.tokenization.tokenizer import Tokenizer
from kvgate.gateway.function_calls.parser import FunctionCall
from kvgate.gateway.generation import GenerationRequest

# Sent in the upstream's own form (below), or always (max_tokens), whoever chose them.
_OWN_FORM = frozenset(("logprobs", "structured_outputs", "max_tokens"))


def request_body(request: GenerationRequest, model: str) -> tuple[str, dict[str, Any]]:
    """The upstream path and body: streamed, unless the caller wants only the whole answer
    (``GenerationRequest.streamed``), which is then asked as one JSON body. The sampling fields are exactly those the caller gave
    (``SamplingParams.given``), explicit defaults included (``temperature: 1.0`` is sent, not
    left to the upstream's generation_config); those it did not give are left out, so the
    upstream's own defaults apply to them as they would to a direct call. ``max_tokens`` is
    always sent (kvgate's limit, whoever chose it)."""
    params = request.params
    # a LoRA adapter's name, as vLLM selects one
    body: dict[str, Any] = {"model": request.adapter or model, "stream": request.streamed}
    if request.streamed:
        body["stream_options"] = {"include_usage": True}
    body["max_tokens"] = params.max_tokens
    for name in sorted(params.given - _OWN_FORM):
        body[name] = getattr(params, name)
    if body.get("top_k") == 0:
        body["top_k"] = -1  # off: vLLM and SGLang both read -1 so (SGLang refuses 0)
    if params.logit_bias is not None and "logit_bias" in body:
        body["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}  # JSON keys
    if params.structured_outputs is not None:
        body["structured_outputs"] = _structured(params.structured_outputs)
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
    if request.functions is not None:
        body.update(request.functions.openai_fields())
    if request.chat_template_kwargs is not None:
        body["chat_template_kwargs"] = request.chat_template_kwargs
    return "/v1/chat/completions", body


def _structured(spec: StructuredOutputs) -> dict[str, Any]:
    """vLLM's ``structured_outputs``: only the constraint given (it refuses a request naming
    two, ``json_object: false`` included), a structural tag as its JSON text."""
    out = {k: v for k, v in vars(spec).items() if v is not None and v is not False}
    if isinstance(out.get("structural_tag"), dict):
        out["structural_tag"] = orjson.dumps(out["structural_tag"]).decode()
    return out


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
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # delta.tool_calls entries
    reasoning: str = ""  # delta.reasoning (an upstream with a reasoning parser)
    tokens: int = 0  # tokens it carries: one per choice with content, or its logprobs' count


FINISH_REASON = re.compile(r"[a-z_]{1,32}")
USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")
MAX_COUNT = 1 << 53


def parse_line(line: str) -> Chunk | None:
    """One SSE line: a chunk, or None for anything that carries none (blank, comments).
    Every field read is checked for its type (a ``StreamError`` if it is wrong)."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return Chunk(done=True)
    return _chunk(_object(data), "delta")


def parse_body(data: bytes) -> Chunk:
    """A non-streamed answer (``choices[].message`` or ``choices[].text``), checked as a
    chunk is; its tool calls as ``delta.tool_calls`` entries (each its own index), its
    tokens the ``usage.completion_tokens`` it reports (else one per logprob, else one)."""
    body = _object(data)
    choices = body.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        message = choice.get("message") if isinstance(choice, dict) else None
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(message, dict) and isinstance(calls, list):
            message["tool_calls"] = [
                {**c, "index": i} if isinstance(c, dict) else c for i, c in enumerate(calls)
            ]
    out = _chunk(body, "message")
    completion_tokens = (out.usage or {}).get("completion_tokens")
    if out.tokens and completion_tokens:
        out.tokens = completion_tokens
    return out


def _chunk(chunk: dict[str, Any], key: str) -> Chunk:
    """A chunk's (``key`` ``delta``) or an answer's (``message``) fields, type-checked."""
    if "error" in chunk:
        error = chunk["error"]
        message = error.get("message", error) if isinstance(error, dict) else error
        raise StreamError(f"{message!s:.300}")
    choices = chunk.get("choices")
    if not isinstance(choices, list | None):
        raise StreamError("malformed chunk from the upstream: 'choices' is not a list")
    out = Chunk(usage=_usage(chunk.get("usage")))
    for choice in choices or ():
        delta = (choice.get(key) or {}) if isinstance(choice, dict) else None
        if not isinstance(delta, dict):
            raise StreamError("malformed chunk from the upstream: a choice is not an object")
        text = delta.get("content") if key in choice else choice.get("text")
        if not isinstance(text or "", str):
            raise StreamError("malformed chunk from the upstream: its text is not a string")
        finish = choice.get("finish_reason")
        if finish is not None and not (isinstance(finish, str) and FINISH_REASON.fullmatch(finish)):
            raise StreamError(f"malformed chunk from the upstream: finish_reason {finish!r:.100}")
        calls = _tool_call_deltas(delta.get("tool_calls"))
        logprobs = _logprobs(choice.get("logprobs"))
        # vLLM 0.32 names it ``reasoning``; ``reasoning_content`` is what older servers sent
        thought = delta.get("reasoning", delta.get("reasoning_content")) or ""
        if not isinstance(thought, str):
            raise StreamError("malformed chunk from the upstream: its reasoning is not a string")
        if text or calls or logprobs or thought:
            out.tokens += max(1, len(logprobs))
        out.text += text or ""
        out.reasoning += thought
        out.tool_calls += calls
        out.finish_reason = finish or out.finish_reason
        out.logprobs += logprobs
    return out


def _usage(raw: Any) -> dict[str, Any] | None:
    """A chunk's ``usage``: an object whose counts are counts, or None."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise StreamError("malformed usage from the upstream: not an object")
    for key in USAGE_COUNTS:
        if raw.get(key) is not None and not _count(raw[key]):
            raise StreamError(f"malformed usage from the upstream: '{key}' is not a count")
    details = raw.get("prompt_tokens_details")
    if details is not None and not (
        isinstance(details, dict)
        and (details.get("cached_tokens") is None or _count(details["cached_tokens"]))
    ):
        raise StreamError("malformed usage from the upstream: 'prompt_tokens_details'")
    return raw


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_COUNT


def _object(data: str | bytes) -> dict[str, Any]:
    """A chunk's JSON object (anything else is a ``StreamError``)."""
    with contextlib.suppress(orjson.JSONDecodeError):
        if isinstance(chunk := orjson.loads(data), dict):
            return chunk
    raise StreamError(f"malformed chunk from the upstream: {data!r:.200}")


def _tool_call_deltas(raw: Any) -> list[dict[str, Any]]:
    """``delta.tool_calls``, each entry rebuilt from the fields the OpenAI API defines once
    their types are checked."""
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise StreamError("malformed tool_calls from the upstream: not a list")
    out = []
    for entry in raw:
        index = entry.get("index") if isinstance(entry, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise StreamError(f"malformed tool_calls from the upstream: {entry!r:.200}")
        clean: dict[str, Any] = {"index": index, **_strings(entry, ("id", "type"))}
        if clean.get("type", "function") != "function":
            raise StreamError(f"malformed tool_calls from the upstream: type {clean['type']!r}")
        if entry.get("function") is not None:
            clean["function"] = _strings(entry["function"], ("name", "arguments"))
        out.append(clean)
    return out


def _strings(raw: Any, keys: tuple[str, ...]) -> dict[str, str]:
    """Those of ``keys`` that ``raw`` (an object) gives, each a string."""
    if not isinstance(raw, dict):
        raise StreamError(f"malformed tool_calls from the upstream: {raw!r:.200} is not an object")
    out = {k: raw[k] for k in keys if raw.get(k) is not None}
    bad = [k for k, v in out.items() if not isinstance(v, str)]
    if bad:
        raise StreamError(f"malformed tool_calls from the upstream: '{bad[0]}' is not a string")
    return out


class ToolCalls:
    """A stream's ``delta.tool_calls`` added up into whole calls, as an OpenAI client does:
    a call's first entry (the next index) gives its id and function name, later ones more
    argument text."""

    def __init__(self) -> None:
        self.calls: list[FunctionCall] = []

    def add(self, entries: list[dict[str, Any]]) -> None:
        for entry in entries:
            index, function = entry["index"], entry.get("function", {})
            if index == len(self.calls):
                if "id" not in entry or not function.get("name"):
                    raise StreamError(
                        f"malformed tool_calls from the upstream: call {index} begins without "
                        "an id and a function name"
                    )
                self.calls.append(FunctionCall(entry["id"], function["name"], ""))
            elif index > len(self.calls):
                raise StreamError(
                    f"malformed tool_calls from the upstream: call {index} before call "
                    f"{len(self.calls)}"
                )
            self.calls[index].arguments += function.get("arguments", "")


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
    return int(details.get("cached_tokens") or 0)  # checked by parse_line
