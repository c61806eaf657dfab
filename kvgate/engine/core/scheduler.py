"""Per-replica scheduling policy: which requests compute how many tokens this step.

Each step, within a token budget:

    1. running decodes (one token each, plus any drafts to verify), oldest first
    2. running chunked prefills, oldest first
    3. waiting requests, strictly FCFS, while a free-block reserve remains

Out of blocks -> drop the decode's drafts, else preempt this replica's newest running
request (it drops its blocks and recomputes later). A waiting request is never overtaken, so
none starves.

Speculative decoding (``kvgate.engine.spec_decode``): a decode with drafts computes 1 + K rows, its
last token and the K drafts, like a prefill chunk over its paged blocks; ``update`` keeps the
accepted drafts, then trims the blocks that held only rejected ones. Blocks are published by
verified tokens only, so no block holding a rejected draft's K/V is ever cached.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvgate.engine.core.kv_cache_manager import KVCacheManager
from kvgate.engine.core.request import Request, RequestStatus
from kvgate.engine.core.serving_stats import ServingMeter
from kvgate.engine.models.packed_linear import trimmed_rows
from kvgate.engine.spec_decode.speculator import Speculator
from kvgate.engine.spec_decode.verify import SampledToken


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    written_blocks: list[int] = field(default_factory=list)  # pending until the step ends

    @property
    def sampling(self) -> list[Request]:
        """Requests whose last token is computed this step: they get a new token."""
        return [r for r in self._completed() if not r.pooling]

    @property
    def pooling(self) -> list[Request]:
        """Embedding requests whose last prompt token is computed this step: they get their
        vector and finish."""
        return [r for r in self._completed() if r.pooling]

    def _completed(self) -> list[Request]:
        return [
            r
            for r, n in zip(self.requests, self.num_new_tokens, strict=True)
            if r.num_computed + n >= r.num_tokens  # beyond: drafts after the last token
        ]

    def __len__(self) -> int:
        return len(self.requests)


def _fit_step_size(batch: ScheduledBatch) -> None:
    """Trim the newest prefill chunks of a large step so it computes `trimmed_rows` tokens (by
    at most 1/8): oneDNN compiles a matmul kernel for every new row count (3.5-5 ms on a Xeon
    with AMX), and a prompt's remaining tokens simply go in the next step. Decodes are never
    cut, nor a prompt's last chunk (cutting it would cost a whole step before its first token);
    a step of at most 256 tokens is left whole (its rows are cheap to pad instead)."""
    total = sum(batch.num_new_tokens)
    if total <= 256:
        return
    excess = total - trimmed_rows(total)
    for i in reversed(range(len(batch))):
        request, n = batch.requests[i], batch.num_new_tokens[i]
        if request.num_computed + n >= request.num_tokens:
            continue
        cut = min(excess, n - 1)
        if cut > 0:
            batch.num_new_tokens[i] -= cut
            excess -= cut


# A prompt whose rest exceeds the step's budget by at most 1/TAIL_SLACK of the budget goes in
# whole: another step costs more than those rows. vllm bench's 256-token random prompts are 257
# with BOS, and at a 256-token budget took a 256-token step and then a 1-token one (c=1 TTFT
# +10-20 ms on a 2-core Xeon). A step stays within 9/8 of the budget.
TAIL_SLACK = 8


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        free_block_reserve: int,
        meter: ServingMeter,
        max_loras: int = 1,
        speculator: Speculator | None = None,
    ):
        self.kv = kv
        self.meter = meter  # what the requests served here measure: fed on the step thread
        self.max_loras = max_loras  # distinct LoRA adapters among the running requests
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.free_block_reserve = free_block_reserve
        self.waiting: list[Request] = []  # sorted by arrival
        self.running: list[Request] = []  # sorted by arrival; the newest is preempted first
        self.num_preemptions = 0
        self.speculator = speculator  # drafts for decodes (None: no speculative decoding)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=_arrival)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        decodes = [r for r in self.running if r.num_tokens - r.num_computed == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed > 1]
        preempted = False
        speculator = self.speculator
        speculating = speculator is not None and speculator.active(len(decodes))
        for request in decodes + prefills:
            if request.status is not RequestStatus.RUNNING or budget <= 0:
                continue
            n = self._chunk(request, budget)
            if speculating and request.num_tokens - request.num_computed == 1:
                assert speculator is not None
                request.spec_token_ids = speculator.propose(request, budget - 1)
                n += len(request.spec_token_ids)
            while not self.kv.allocate_slots(request, n):
                if request.spec_token_ids:  # drafts give way before any request does
                    n -= len(request.spec_token_ids)
                    request.spec_token_ids = []
                    continue
                victim = self.running[-1]
                budget += self._preempt(victim, batch)
                preempted = True
                if victim is request:
                    break
            else:
                batch.requests.append(request)
                batch.num_new_tokens.append(n)
                budget -= n
        if not preempted:
            budget = self._admit(batch, budget)
        _fit_step_size(batch)
        for request, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            verified = n - len(request.spec_token_ids)
            batch.written_blocks += self.kv.publish_full_blocks(request, verified)
        return batch

    def _admit(self, batch: ScheduledBatch, budget: int) -> int:
        now = time.monotonic()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not self._adapter_fits(request):
                break  # FCFS: it waits until an adapter's requests finish
            hit = self.kv.match_prefix(request)
            n = self._chunk(request, budget)
            if not self.kv.allocate_slots(request, n, reserve=self.free_block_reserve):
                self.kv.free(request)
                break
            self.waiting.pop(0)
            self.kv.record_lookup(request, hit)
            if request.cached_tokens is None:
                request.cached_tokens = hit
            request.status = RequestStatus.RUNNING
            self.meter.scheduled(request, now)
            bisect.insort(self.running, request, key=_arrival)
            batch.requests.append(request)
            batch.num_new_tokens.append(n)
            budget -= n
        return budget

    def _chunk(self, request: Request, budget: int) -> int:
        """The tokens of ``request`` this step computes, of the ``budget`` left (> 0)."""
        rest = request.num_tokens - request.num_computed
        return rest if rest <= budget + self.max_num_batched_tokens // TAIL_SLACK else budget

    def _adapter_fits(self, request: Request) -> bool:
        """Whether running ``request`` keeps at most ``max_loras`` adapters running."""
        if request.lora is None:
            return True
        running = {id(r.lora) for r in self.running if r.lora is not None}
        return id(request.lora) in running or len(running) < self.max_loras

    def _preempt(self, victim: Request, batch: ScheduledBatch) -> int:
        """Send ``victim`` back to waiting; returns the budget it had taken this step."""
        self.running.remove(victim)
        self.kv.free(victim)
        victim.spec_token_ids = []
        self.add(victim)
        self.num_preemptions += 1
        self.meter.preempted(victim)
        if victim in batch.requests:
            i = batch.requests.index(victim)
            batch.requests.pop(i)
            return batch.num_new_tokens.pop(i)
        return 0

    def update(
        self,
        batch: ScheduledBatch,
        sampled: Sequence[SampledToken],
        pooled: Sequence[list[float]] = (),
        accepted: Sequence[list[SampledToken]] = (),
    ) -> list[Request]:
        """Apply a finished step: advance computed counts, append sampled tokens (in the
        order of ``batch.sampling``, each after the drafts ``accepted`` kept of its request),
        finish embedding requests with their vectors (in the order of ``batch.pooling``),
        free finished requests. Returns requests with news."""
        self.kv.mark_written(batch.written_blocks)
        now, meter = time.monotonic(), self.meter
        sampling, pooling = batch.sampling, batch.pooling
        for request, n in zip(batch.requests, batch.num_new_tokens, strict=True):
            request.num_computed += n - len(request.spec_token_ids)
        meter.step(sum(batch.num_new_tokens))
        for i, (request, (token_id, logprobs)) in enumerate(zip(sampling, sampled, strict=True)):
            before = request.num_tokens
            if request.spec_token_ids:
                self._keep_drafts(request, accepted[i])
            if not request.finished:
                request.append_output(token_id, logprobs)
            if request.num_tokens > before:  # a grammar's dead end drops the token
                meter.tokens(request, request.num_tokens - before, now)
        for request, embedding in zip(pooling, pooled, strict=True):
            request.finish_pooled(embedding)
        changed = sampling + pooling
        for request in changed:
            if request.finished:
                self.running.remove(request)
                self.kv.free(request)
                if not request.pooling:
                    meter.finished(request, request.finish_reason or "stop", now)
                    self._forget(request, keep_reply=True)
        return changed

    def _keep_drafts(self, request: Request, kept: list[SampledToken]) -> None:
        """Append the drafts the step accepted (their K/V is verified), up to a stop they
        reach, and release the blocks that held only rejected ones."""
        drafted, request.spec_token_ids = len(request.spec_token_ids), []
        request.num_computed += len(kept)
        self.meter.drafted(drafted, len(kept))
        if self.speculator is not None:
            self.speculator.verified(request, drafted, len(kept))
        for token_id, logprobs in kept:
            request.append_output(token_id, logprobs)
            if request.finished:
                return
        self.kv.trim(request)

    def _forget(self, request: Request, keep_reply: bool) -> None:
        if self.speculator is not None:
            self.speculator.finished(request, keep_reply)

    def abort(self, request: Request, reason: str = "abort") -> None:
        """Drop a request wherever it is and free its blocks (call between steps); a
        generation ends with ``reason`` ("abort": its reader let go; "stop": a stop string
        ended it; "error": its step failed)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv.free(request)
        request.spec_token_ids = []
        if not request.finished and not request.pooling:
            self._forget(request, keep_reply=reason == "stop")
            self.meter.finished(request, reason, time.monotonic())
        request.status = RequestStatus.FINISHED


def _arrival(request: Request) -> int:
    return request.arrival
