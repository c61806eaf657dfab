"""One request's state as it moves waiting -> running (-> preempted -> waiting) -> finished.

``token_ids`` is prompt + output so far; ``num_computed`` of them have K/V in the cache. A
preempted request keeps its output and recomputes ``token_ids`` later (prefix caching makes
that cheap). Stop rules live here because they need the text as it grows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine.outputs import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # FCFS order within the engine
    hash_root: bytes  # root of the chained block hashes (model, cache scheme, tenant salt)
    block_hashes: list[bytes]  # of full blocks of token_ids, extended as tokens arrive
    eos_token_ids: frozenset[int]
    max_model_len: int
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None = None
    cache_key: str | None = None
    replica: int = 0
    token_ids: list[int] = field(init=False)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0  # leading blocks already published in the pool
    cached_tokens: int | None = None  # prefix-cache hit at first admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    _sent_tokens: int = 0
    _sent_chars: int = 0

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token_id: int, logprobs: dict[int, float] | None = None) -> None:
        """Take one sampled token and apply the stop rules, in vLLM's order: stop token ids
        and EOS (not shown as text), stop strings (trimmed from the text), then length; the
        first two only once ``min_tokens`` have been generated."""
        self.token_ids.append(token_id)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
        params = self.params
        may_stop = len(self.token_ids) - self.num_prompt_tokens >= params.min_tokens
        if may_stop and (
            token_id in params.stop_token_ids
            or (not params.ignore_eos and token_id in self.eos_token_ids)
        ):
            self._finish("stop")
            return
        new_text = self.detokenizer.push([token_id])
        if new_text:
            self.text += new_text
            if may_stop and params.stop and self._trim_stop_string(len(new_text)):
                self._finish("stop")
                return
        if len(self.token_ids) - self.num_prompt_tokens >= params.max_tokens or (
            len(self.token_ids) >= self.max_model_len
        ):
            self._finish("length")

    def _trim_stop_string(self, new_chars: int) -> bool:
        """Cut the text before the earliest stop string that the new text completed."""
        longest = max(len(stop) for stop in self.params.stop)
        start = max(0, len(self.text) - new_chars - longest + 1)
        hits = [i for stop in self.params.stop if (i := self.text.find(stop, start)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def _finish(self, reason: FinishReason) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason

    def take_output(self) -> RequestOutput:
        """Cumulative output with the delta since the previous call. While stop strings may
        still match, their possible beginning is held back from the delta."""
        visible = len(self.text)
        if self.params.stop and not self.finished:
            visible -= max(len(stop) for stop in self.params.stop) - 1
        visible = max(visible, self._sent_chars)
        output = self.output_token_ids
        result = RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=output,
            text=self.text[:visible],
            delta_token_ids=output[self._sent_tokens :],
            delta_text=self.text[self._sent_chars : visible],
            finished=self.finished,
            finish_reason=self.finish_reason,
            cached_tokens=self.cached_tokens or 0,
            replica=self.replica,
            logprobs=None if self.logprobs is None else list(self.logprobs),
        )
        self._sent_tokens, self._sent_chars = len(output), visible
        return result
