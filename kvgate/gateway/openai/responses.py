"""OpenAI response bodies and stream chunks, in the shapes the openai SDK and vLLM use."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvgate.gateway.generation import Completion, TextDelta


@dataclass
class Choice:
    """One choice as it accumulates (text, token ids, logprobs) for a non-streamed answer."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    done: Completion | None = None

    def add(self, delta: TextDelta) -> None:
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            self.logprobs.extend(delta.logprobs)


@dataclass(frozen=True)
class Envelope:
    """What every body and chunk of one response shares."""

    id: str
    created: int
    model: str

    @classmethod
    def new(cls, prefix: str, model: str) -> Envelope:
        # 32 random hex digits, as uuid4().hex gives them, without building a UUID per call
        return cls(f"{prefix}-{os.urandom(16).hex()}", int(time.time()), model)

    def wrap(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage_of(completions: Sequence[Completion], prompts: int = 1) -> dict[str, Any]:
    """Prompt tokens once per prompt (its ``n`` choices share it), completion tokens summed;
    cached tokens are those of each prompt's first choice (the one that prefilled)."""
    n = len(completions) // prompts
    firsts = completions[::n]
    return usage(
        sum(c.prompt_tokens for c in firsts),
        sum(c.completion_tokens for c in completions),
        sum(c.cached_tokens for c in firsts),
    )


class TokenText:
    """Token ids → the strings logprobs show (cached: the same ids recur)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._cache) < 65_536:
                self._cache[token_id] = text
        return text


def chat_logprobs(
    token_ids: list[int], entries: list[dict[int, float]], top: int, text: TokenText
) -> dict[str, Any]:
    """``choices[].logprobs`` of a chat completion: one entry per token, its top ``top``."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        token = text(token_id)
        content.append(
            {
                "token": token,
                "logprob": entry.get(token_id, float("-inf")),
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {"token": (t := text(i)), "logprob": lp, "bytes": list(t.encode())}
                    for i, lp in list(entry.items())[:top]
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    token_ids: list[int],
    entries: list[dict[int, float]],
    top: int,
    text: TokenText,
    offset: int = 0,
) -> dict[str, Any]:
    """``choices[].logprobs`` of a (legacy) completion: parallel lists and text offsets."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries, strict=False):
        token = text(token_id)
        tokens.append(token)
        token_logprobs.append(entry.get(token_id, float("-inf")))
        tops.append({text(i): lp for i, lp in list(entry.items())[:top]})
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }
