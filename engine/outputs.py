"""What the engine hands back for a request, cumulative, with the newest delta alongside."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length"]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    cached_tokens: int = 0
    replica: int = 0
    # One dict {token_id: logprob} per generated token, when SamplingParams.logprobs is set.
    logprobs: list[dict[int, float]] | None = None
