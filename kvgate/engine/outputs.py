"""What the engine hands back: per-step token deltas, the request outputs built from them, and
embedding requests' vectors.

A replica's step thread produces ``StepOutput`` (new token ids only: no text, no copies of the
whole output). ``kvgate.engine.output_processor`` turns those into ``RequestOutput`` for the reader,
off the step thread, in the shape the reader asked for (``OutputKind``), as vLLM's output
processor does.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length"]


class OutputKind(enum.Enum):
    """What ``RequestOutput.text`` / ``token_ids`` / ``logprobs`` hold, as in vLLM."""

    CUMULATIVE = "cumulative"  # everything so far, in every output
    DELTA = "delta"  # only what is new since the previous output (streaming front doors)
    FINAL_ONLY = "final_only"  # one output, at the end, with everything


@dataclass(slots=True)
class StepOutput:
    """One request's news from one or more steps (merged while the reader has not taken it)."""

    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None
    finished: bool
    finish_reason: FinishReason | None
    cached_tokens: int
    replica: int
    stop_reason: str | None = None  # a "stop" no stop token explains (its last token is text)
    embedding: list[float] | None = None  # an embedding request's vector, once pooled

    def merge(self, later: StepOutput) -> None:
        """Fold a later delta of the same request into this one."""
        self.new_token_ids.extend(later.new_token_ids)
        if self.new_logprobs is not None and later.new_logprobs is not None:
            self.new_logprobs.extend(later.new_logprobs)
        self.finished, self.finish_reason = later.finished, later.finish_reason
        self.stop_reason = later.stop_reason
        self.cached_tokens, self.replica = later.cached_tokens, later.replica
        self.embedding = later.embedding


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    num_output_tokens: int = 0  # generated so far, whatever the kind
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | None = None  # why it stopped, when no stop token or string did
    cached_tokens: int = 0
    replica: int = 0
    # One dict {token_id: logprob} per token in ``token_ids``, when SamplingParams.logprobs is set.
    logprobs: list[dict[int, float]] | None = None


@dataclass
class EmbeddingOutput:
    """An embedding request's answer: its prompt's last-token final hidden state (after the
    final norm, before ``lm_head``), L2-normalized, as fp32 values."""

    request_id: str
    prompt_token_ids: list[int]
    embedding: list[float]
    cached_tokens: int = 0
    replica: int = 0
