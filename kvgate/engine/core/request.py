"""One request's state as it moves waiting -> running (-> preempted -> waiting) -> finished.

``token_ids`` is prompt + output so far; ``num_computed`` of them have K/V in the cache. A
preempted request keeps its output and recomputes ``token_ids`` later (prefix caching makes
that cheap). Only the stop rules that need no text live here (stop and EOS token ids,
lengths): detokenizing and stop strings happen off the step thread, in
``kvgate.engine.output_processor``, which aborts a request whose text hit a stop string.

An embedding request (``pooling``) is a prompt prefilled like any other (batched with
generations, within the KV budget, reusing cached prefix blocks); the step that computes its
last token hands back that token's final hidden state instead of sampling, and it finishes.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvgate.engine.outputs import FinishReason, StepOutput
from kvgate.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvgate.engine.models.lora import LoRAAdapter
    from kvgate.engine.sampling.structured import GrammarState


# A grammar's mask left no token the sampler could draw (say min_tokens banned the only end it
# allowed): the request stops there, without the token, and its output says so.
GRAMMAR_DEAD_END = "structured output: the grammar allowed no token the sampler could draw"


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
    generator: torch.Generator | None = None
    cache_key: str | None = None
    grammar: GrammarState | None = None  # structured outputs: advanced with each token
    pooling: bool = False  # an embedding request: pooled at its last prompt token, never sampled
    embedding: list[float] | None = None  # its vector, once pooled
    lora: LoRAAdapter | None = None  # the adapter its rows run with (None: the base model)
    cache_salt: str | None = None  # the tenant salt in hash_root (told in KV-cache events)
    replica: int = 0
    token_ids: list[int] = field(init=False)
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)  # drafts the scheduled step verifies
    num_registered_blocks: int = 0  # leading blocks already published in the pool
    num_cached: int = 0  # leading tokens whose K/V came with matched blocks: never rewritten
    cached_tokens: int | None = None  # prefix-cache hit at first admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | None = None  # why a "stop" that no stop token or string explains
    # Its clock (``kvgate.engine.core.serving_stats``): when the engine took it, first scheduled it, and
    # when its first and latest tokens came (time.monotonic); how often it was preempted.
    arrival_time: float = field(default_factory=time.monotonic)
    scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float = 0.0
    num_preemptions: int = 0
    _new_logprobs: list[dict[int, float]] = field(default_factory=list)
    _sent_tokens: int = 0  # output tokens already handed out by take_step_output

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

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
        """Take one sampled token and apply the token stop rules, in vLLM's order: stop token
        ids and EOS (only once ``min_tokens`` have been generated), then length (stop strings
        are the output processor's). A grammar that completes, or that cannot take the token
        (its mask left nothing the model could sample: the token is dropped), stops it."""
        if self.grammar is not None and not self.grammar.accept(token_id):
            self._finish("stop")
            self.stop_reason = GRAMMAR_DEAD_END
            return
        self.token_ids.append(token_id)
        if self.params.logprobs is not None and logprobs is not None:
            self._new_logprobs.append(logprobs)
        params = self.params
        if self.grammar is not None and self.grammar.terminated:
            self._finish("stop")
            return
        may_stop = len(self.token_ids) - self.num_prompt_tokens >= params.min_tokens
        if may_stop and (
            token_id in params.stop_token_ids
            or (not params.ignore_eos and token_id in self.eos_token_ids)
        ):
            self._finish("stop")
        elif len(self.token_ids) - self.num_prompt_tokens >= params.max_tokens or (
            len(self.token_ids) >= self.max_model_len
        ):
            self._finish("length")

    def finish_pooled(self, embedding: list[float]) -> None:
        """An embedding request's last prompt token is computed: it ends with its vector."""
        self.embedding = embedding
        self._finish("stop")

    def _finish(self, reason: FinishReason) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason

    def take_step_output(self) -> StepOutput:
        """The tokens (and logprobs) new since the previous call: O(new tokens), never a copy
        of the whole output, so a long generation stays linear."""
        start = self.num_prompt_tokens + self._sent_tokens
        new_ids = self.token_ids[start:]
        self._sent_tokens += len(new_ids)
        logprobs, self._new_logprobs = self._new_logprobs, []
        return StepOutput(
            new_token_ids=new_ids,
            new_logprobs=logprobs if self.params.logprobs is not None else None,
            finished=self.finished,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            cached_tokens=self.cached_tokens or 0,
            replica=self.replica,
            embedding=self.embedding,
        )
