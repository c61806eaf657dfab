"""What the engine measures of the generations it serves: token counts and request timings,
with the meanings, bucket bounds and names (less the ``vllm:`` prefix) of vLLM 0.32's
serving metrics (``vllm/v1/metrics``), so a dashboard built for vLLM reads them unchanged.

Each replica's step thread owns one ``ServingMeter`` and feeds it as its scheduler admits,
preempts, steps and finishes requests: no lock on the hot path, and the figures are those
of the engine itself, current at every step, whichever process reads them. ``snapshot``
hands out a picklable ``ServingStats`` (``EngineStats.serving``); the engine in a process of
its own ships it to every API process with the rest of its state, so each ``--workers``
process exports the whole server's figures (no prometheus-client multiprocess mode).

Times are ``time.monotonic`` seconds. A request's clock starts when the engine takes it
(``Request.arrival_time``), as vLLM's engine core stamps its QUEUED event; the intervals are
vLLM's: queue (arrival → first scheduled), prefill (first scheduled → first token), decode
(first → last token), inference (first scheduled → last token), e2e (arrival → finish).
Speculative decoding's counters are vLLM's ``spec_decode_*`` (``vllm/v1/spec_decode/metrics.py``):
drafts verified, their tokens, the tokens accepted, and accepted per draft position.
Each choice of an ``n > 1`` call is an engine request of its own: ``request_params_n`` reads 1
for each, and ``request_max_num_generation_tokens`` is each choice's own length.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvgate.engine.core.request import Request

# vLLM's bucket families (vllm/v1/metrics/buckets.py).
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = tuple(float(2**i) for i in (0, *range(3, 15)))  # 1, 8 … 16384
REQUEST_PARAMS_N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)
REQUEST_NUM_PREEMPTIONS_BUCKETS = (1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0)

# How a generation ended, as vLLM's ``request_success_total`` labels it (every one exported,
# zeros too, so a dashboard's sum over them is whole). kvgate never ends one for repetition.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

# Histograms of seconds, of a request's token counts (bounded by the context length), and of
# the rest, each with its buckets; the names are vLLM's, less ``vllm:``.
SECONDS_HISTOGRAMS = {
    "time_to_first_token_seconds": TIME_TO_FIRST_TOKEN_BUCKETS,
    "inter_token_latency_seconds": INTER_TOKEN_LATENCY_BUCKETS,
    "request_time_per_output_token_seconds": INTER_TOKEN_LATENCY_BUCKETS,
    "e2e_request_latency_seconds": REQUEST_LATENCY_BUCKETS,
    "request_queue_time_seconds": REQUEST_LATENCY_BUCKETS,
    "request_inference_time_seconds": REQUEST_LATENCY_BUCKETS,
    "request_prefill_time_seconds": REQUEST_LATENCY_BUCKETS,
    "request_decode_time_seconds": REQUEST_LATENCY_BUCKETS,
}
TOKEN_HISTOGRAMS = (
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_max_num_generation_tokens",
    "request_params_max_tokens",
    "request_prefill_kv_computed_tokens",
)
COUNT_HISTOGRAMS = {
    "iteration_tokens_total": ITERATION_TOKENS_BUCKETS,
    "request_params_n": REQUEST_PARAMS_N_BUCKETS,
    "request_num_preemptions": REQUEST_NUM_PREEMPTIONS_BUCKETS,
}


def request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series up to the context length (``build_1_2_5_buckets``)."""
    bounds: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(bounds)
            bounds.append(float(mantissa * scale))
        scale *= 10


@dataclass
class Histogram:
    """Counts per bucket (the last one past every bound: +Inf) and the sum observed."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.total)

    def add(self, other: Histogram) -> None:
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.total += other.total


@dataclass
class SpecDecodeStats:
    """Speculative decoding, cumulative: vLLM's ``spec_decode_num_*_total`` counters."""

    drafts: int = 0  # requests' steps that verified drafts
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # accepted at draft position i

    def add(self, other: SpecDecodeStats) -> None:
        self.drafts += other.drafts
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.accepted_per_position = [
            a + b
            for a, b in zip(self.accepted_per_position, other.accepted_per_position, strict=True)
        ]

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.drafts, self.draft_tokens, self.accepted_tokens, list(self.accepted_per_position)
        )


@dataclass
class ServingStats:
    """Cumulative figures since the engine started (one replica's, or summed)."""

    prompt_tokens: int = 0  # of generations that produced a first token, cached ones included
    cached_prompt_tokens: int = 0  # of those, found in the prefix cache
    generation_tokens: int = 0
    preemptions: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    histograms: dict[str, Histogram] = field(default_factory=dict)
    spec: SpecDecodeStats = field(default_factory=lambda: SpecDecodeStats())

    @classmethod
    def empty(cls, max_model_len: int, num_speculative_tokens: int = 0) -> ServingStats:
        token_bounds = request_tokens_buckets(max_model_len)
        bounds = {
            **SECONDS_HISTOGRAMS,
            **dict.fromkeys(TOKEN_HISTOGRAMS, token_bounds),
            **COUNT_HISTOGRAMS,
        }
        return cls(
            histograms={name: Histogram(b) for name, b in bounds.items()},
            spec=SpecDecodeStats(accepted_per_position=[0] * num_speculative_tokens),
        )

    @classmethod
    def total(cls, parts: Iterable[ServingStats]) -> ServingStats:
        whole: ServingStats | None = None
        for part in parts:
            if whole is None:
                whole = part.copy()
                continue
            whole.prompt_tokens += part.prompt_tokens
            whole.cached_prompt_tokens += part.cached_prompt_tokens
            whole.generation_tokens += part.generation_tokens
            whole.preemptions += part.preemptions
            for reason, count in part.finished.items():
                whole.finished[reason] = whole.finished.get(reason, 0) + count
            for name, histogram in part.histograms.items():
                whole.histograms[name].add(histogram)
            whole.spec.add(part.spec)
        return whole if whole is not None else cls()

    def copy(self) -> ServingStats:
        return ServingStats(
            self.prompt_tokens,
            self.cached_prompt_tokens,
            self.generation_tokens,
            self.preemptions,
            dict(self.finished),
            {name: h.copy() for name, h in self.histograms.items()},
            self.spec.copy(),
        )


class ServingMeter:
    """One replica's figures, fed by its step thread (``kvgate.engine.core.scheduler.Scheduler``)."""

    def __init__(self, max_model_len: int, num_speculative_tokens: int = 0) -> None:
        self.stats = ServingStats.empty(max_model_len, num_speculative_tokens)
        self._histograms = self.stats.histograms

    def snapshot(self) -> ServingStats:
        """A copy another thread may keep (read while the step thread writes: each count is
        whole, a histogram's sum may trail its counts by the observation in flight)."""
        return self.stats.copy()

    def scheduled(self, request: Request, now: float) -> None:
        if request.scheduled_time is None:  # a preempted request's return is not its start
            request.scheduled_time = now

    def preempted(self, request: Request) -> None:
        request.num_preemptions += 1
        self.stats.preemptions += 1

    def step(self, tokens_computed: int) -> None:
        self._histograms["iteration_tokens_total"].observe(tokens_computed)

    def drafted(self, num_draft_tokens: int, num_accepted: int) -> None:
        """A request verified ``num_draft_tokens`` drafts and accepted the first ``num_accepted``."""
        spec = self.stats.spec
        spec.drafts += 1
        spec.draft_tokens += num_draft_tokens
        spec.accepted_tokens += num_accepted
        per_position = spec.accepted_per_position
        for position in range(min(num_accepted, len(per_position))):
            per_position[position] += 1

    def tokens(self, request: Request, new_tokens: int, now: float) -> None:
        """``request`` got ``new_tokens`` (> 0) output tokens in the step that ended ``now``."""
        stats, histograms = self.stats, self._histograms
        stats.generation_tokens += new_tokens
        if request.first_token_time is None:
            request.first_token_time = now
            stats.prompt_tokens += request.num_prompt_tokens
            stats.cached_prompt_tokens += request.cached_tokens or 0
            histograms["time_to_first_token_seconds"].observe(now - request.arrival_time)
        else:
            histograms["inter_token_latency_seconds"].observe(now - request.last_token_time)
        request.last_token_time = now

    def finished(self, request: Request, reason: str, now: float) -> None:
        """``request`` ended (``reason``: one of FINISH_REASONS) at ``now``."""
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        scheduled = request.scheduled_time if request.scheduled_time is not None else now
        first = request.first_token_time if request.first_token_time is not None else now
        last = request.last_token_time if request.last_token_time is not None else first
        generated = request.num_tokens - request.num_prompt_tokens
        decode = last - first
        prompt, cached = request.num_prompt_tokens, request.cached_tokens or 0
        for name, value in (
            ("e2e_request_latency_seconds", now - request.arrival_time),
            ("request_queue_time_seconds", scheduled - request.arrival_time),
            ("request_prefill_time_seconds", first - scheduled),
            ("request_decode_time_seconds", decode),
            ("request_inference_time_seconds", last - scheduled),
            ("request_time_per_output_token_seconds", decode / max(generated - 1, 1)),
            ("request_prompt_tokens", prompt),
            ("request_generation_tokens", generated),
            ("request_max_num_generation_tokens", generated),
            ("request_prefill_kv_computed_tokens", prompt - cached),
            ("request_num_preemptions", request.num_preemptions),
            ("request_params_n", 1),
            ("request_params_max_tokens", request.params.max_tokens),
        ):
            self._histograms[name].observe(value)
