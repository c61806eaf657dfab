"""Prometheus metrics: kvgate request counters plus vLLM-named engine gauges.

Each app owns a private `CollectorRegistry`, so tests (and embedders) can build several apps in
one process without metric-name clashes. Engine figures are read at scrape time by a custom
collector rather than pushed on every step, so the hot path pays nothing for them. The engine
series use the names vLLM exports, so inference routers (llm-d, the Gateway API inference
extension) can scrape a kvgate pod as if it were a vLLM pod.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from kvgate.engine.core import serving_stats
from kvgate.engine.stats import EngineStats, ReplicaStats

# From half a millisecond (a cached list answer) to minutes (a long generation).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, *Histogram.DEFAULT_BUCKETS[:-1], 30.0, 60.0, 120.0)

# (family kind, vLLM metric name, help text as vLLM words it, stats field)
ENGINE_SERIES = (
    (
        GaugeMetricFamily,
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        "num_running",
    ),
    (
        GaugeMetricFamily,
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        "num_waiting",
    ),
    (
        GaugeMetricFamily,
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        "kv_usage",
    ),
    (
        CounterMetricFamily,
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        "prefix_queries",
    ),
    (
        CounterMetricFamily,
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        "prefix_hits",
    ),
)

# (vLLM counter name less _total, help, ServingStats field)
SERVING_COUNTERS = (
    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    ("vllm:generation_tokens", "Number of generation tokens processed.", "generation_tokens"),
    (
        "vllm:prompt_tokens_cached",
        "Number of cached prompt tokens (local + external).",
        "cached_prompt_tokens",
    ),
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "preemptions"),
)

# ServingStats histogram → its help, as vLLM words it (the name is "vllm:" + the key).
SERVING_HISTOGRAMS = {
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per "
    "request.",
    "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "request_generation_tokens": "Number of generation tokens processed.",
    "iteration_tokens_total": "Histogram of number of tokens per engine_step.",
    "request_max_num_generation_tokens": "Histogram of maximum number of requested generation "
    "tokens.",
    "request_params_n": "Histogram of the n request parameter.",
    "request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "request_num_preemptions": "Histogram of the number of times a request was preempted.",
    "request_prefill_kv_computed_tokens": "Histogram of new KV tokens computed during prefill "
    "(excluding cached tokens).",
}

# vLLM's label values with nothing behind them here (no KV connector, no offloading tier, no
# token-count queue limit): exported as zeros, so a sum over a family's labels stays whole.
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_TIERS = ("device", "host", "p2p", "disk", "external_unspecified")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
FamilyKind = CounterMetricFamily | GaugeMetricFamily
ENGINE = "0"  # vLLM's engine label: the replicas share one KV pool and one admission


class EngineCollector(Collector):
    """Turns one `kvgate.engine.stats()` snapshot into vLLM-compatible metric families per scrape.

    The `vllm:*` series carry vLLM 0.32's labels, `model_name` and `engine` (always "0": to a
    router the pod is one engine, as a single-engine vLLM), so a router reading them gets the
    pod's total; per-replica figures go to separate `kvgate_replica_*` families with a
    `replica` label rather than mixing label sets in one family.

    The per-request figures (token counters, latency histograms) are measured by the engine
    itself (`kvgate.engine.core.serving_stats`) and read here from the same snapshot as the gauges. With
    the engine in a process of its own that snapshot comes with its state (at most
    `kvgate.engine.process.core_process.STATE_INTERVAL_S` old), the same for every API process: with
    `--workers N` each worker's `/metrics` is the whole server's, and a scraper may read any.
    """

    def __init__(self, engine_stats: Callable[[], EngineStats], model_name: str) -> None:
        self._engine_stats = engine_stats
        self._model_name = model_name
        self._labels = [model_name, ENGINE]

    def collect(self) -> Iterator[Metric]:
        stats = self._engine_stats()
        for kind, name, documentation, field in ENGINE_SERIES:
            family = kind(name, documentation, labels=["model_name", "engine"])
            family.add_metric(self._labels, getattr(stats, field))
            yield family
        yield from self._serving(stats)
        yield self._cache_config(stats)
        if stats.max_loras is not None:
            yield self._lora_info(stats)
        yield from self._per_replica(stats.per_replica)

    def _serving(self, stats: EngineStats) -> Iterator[Metric]:
        serving, labels = stats.serving, self._labels
        for name, documentation, field in SERVING_COUNTERS:
            yield self._family(CounterMetricFamily, name, documentation, getattr(serving, field))
        computed = serving.prompt_tokens - serving.cached_prompt_tokens
        yield self._by(
            CounterMetricFamily,
            "vllm:prompt_tokens_by_source",
            "Number of prompt tokens by source.",
            "source",
            dict(zip(PROMPT_SOURCES, (computed, serving.cached_prompt_tokens, 0), strict=True)),
        )
        yield self._by(
            CounterMetricFamily,
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them.",
            "source",
            {tier: stats.prefix_hits if tier == "device" else 0 for tier in CACHE_TIERS},
        )
        yield self._by(
            CounterMetricFamily,
            "vllm:request_success",
            "Count of successfully processed requests.",
            "finished_reason",
            serving.finished,
        )
        yield self._by(
            GaugeMetricFamily,
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Sum of all reasons equals "
            "vllm:num_requests_waiting.",
            "reason",
            {"capacity": stats.num_waiting, "deferred": 0},
        )
        rejections = CounterMetricFamily(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            labels=["model_name", "reason"],
        )
        for reason in ADMISSION_REASONS:
            count = stats.admission_rejections if reason == "max_num_queued_reqs" else 0
            rejections.add_metric([self._model_name, reason], count)
        yield rejections
        if serving.spec.accepted_per_position:  # speculative decoding is on
            yield from self._spec_decode(serving.spec)
        for key, documentation in SERVING_HISTOGRAMS.items():
            histogram = serving.histograms.get(key)
            family = HistogramMetricFamily(
                f"vllm:{key}", documentation, labels=["model_name", "engine"]
            )
            if histogram is not None:
                family.add_metric(labels, _cumulative(histogram), histogram.total)
            yield family

    def _spec_decode(self, spec: serving_stats.SpecDecodeStats) -> Iterator[Metric]:
        """vLLM's ``spec_decode_*`` counters: acceptance rate is accepted over draft tokens,
        mean accepted length 1 + accepted over drafts."""
        for name, documentation, value in (
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", spec.drafts),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", spec.draft_tokens),
            (
                "vllm:spec_decode_num_accepted_tokens",
                "Number of accepted tokens.",
                spec.accepted_tokens,
            ),
        ):
            yield self._family(CounterMetricFamily, name, documentation, value)
        per_position = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=["model_name", "engine", "position"],
        )
        for position, count in enumerate(spec.accepted_per_position):
            per_position.add_metric([*self._labels, str(position)], count)
        yield per_position

    def _family(
        self, kind: type[FamilyKind], name: str, documentation: str, value: float
    ) -> Metric:
        family = kind(name, documentation, labels=["model_name", "engine"])
        family.add_metric(self._labels, value)
        return family

    def _by(
        self,
        kind: type[FamilyKind],
        name: str,
        documentation: str,
        label: str,
        values: dict[str, int],
    ) -> Metric:
        family = kind(name, documentation, labels=["model_name", "engine", label])
        for value, count in values.items():
            family.add_metric([*self._labels, value], count)
        return family

    def _cache_config(self, stats: EngineStats) -> Metric:
        labels = {
            "block_size": str(stats.block_size),
            "num_gpu_blocks": str(stats.num_blocks),
            "cache_dtype": stats.cache_dtype,
            "enable_prefix_caching": str(stats.enable_prefix_caching),
            "engine": ENGINE,
        }
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(labels),
        )
        info.add_metric(list(labels.values()), 1)
        return info

    def _lora_info(self, stats: EngineStats) -> Metric:
        """vLLM's adapters gauge: which adapters are running and waiting now (comma lists),
        valued at the time they were read, as vLLM's ``set_to_current_time``."""
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        adapters = [",".join(stats.waiting_adapters), ",".join(stats.running_adapters)]
        info.add_metric([str(stats.max_loras), *adapters], time.time())
        return info

    def _per_replica(self, replicas: Sequence[ReplicaStats]) -> Iterator[Metric]:
        for kind, name, documentation, field in ENGINE_SERIES:
            family = kind(
                name.replace("vllm:", "kvgate_replica_"),
                f"{documentation} Per engine replica.",
                labels=["model_name", "replica"],
            )
            for index, replica in enumerate(replicas):
                family.add_metric([self._model_name, str(index)], getattr(replica, field))
            yield family


def _cumulative(histogram: serving_stats.Histogram) -> list[tuple[str, float]]:
    """Prometheus buckets: the count at or below each bound (written as vLLM's are: "1.0"),
    then +Inf (every count)."""
    bounds = [*(repr(float(b)) for b in histogram.bounds), "+Inf"]
    return list(zip(bounds, itertools.accumulate(histogram.counts), strict=True))


class Metrics:
    """One app's metrics: request outcomes, latencies, misc counters, engine figures."""

    def __init__(
        self, engine_stats: Callable[[], EngineStats] | None = None, model_name: str = ""
    ) -> None:
        self.registry = CollectorRegistry()
        self._requests = Counter(
            "kvgate_requests",
            "Requests by front door (mcp, openai), method or route, tool and outcome.",
            ["api", "method", "tool", "outcome"],
            registry=self.registry,
        )
        self._duration = Histogram(
            "kvgate_request_duration_seconds",
            "MCP request latency by method, until the last byte.",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._task_duration = Histogram(
            "kvgate_task_duration_seconds",
            "MCP task generations run by this process, from creation to their final state.",
            ["state"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self._request_counters: dict[tuple[str, str, str, str], Counter] = {}
        self._durations: dict[str, Histogram] = {}
        self._counters: dict[str, tuple[Counter, tuple[str, ...]]] = {}
        self._children: dict[tuple[Any, ...], Counter] = {}  # count()'s, by name and labels
        if engine_stats is not None:
            self.registry.register(EngineCollector(engine_stats, model_name))

    def observe(
        self, method: str, tool: str | None, outcome: str, seconds: float, api: str = "mcp"
    ) -> None:
        """Record one finished request; `tool` is None for anything but `tools/call`.

        Labelled children are kept in plain dicts: `labels()` validates and locks on every call,
        which cost more than the rest of a cached `tools/list` answer.
        """
        key = (api, method, tool or "", outcome)
        counter = self._request_counters.get(key)
        if counter is None:
            counter = self._request_counters[key] = self._requests.labels(*key)
        counter.inc()
        histogram = self._durations.get(method)
        if histogram is None:
            histogram = self._durations[method] = self._duration.labels(method)
        histogram.observe(seconds)

    def task_finished(self, state: str, seconds: float) -> None:
        """One task this process ran reached ``state`` (completed, failed, cancelled)."""
        self._task_duration.labels(state).observe(seconds)

    def count(self, name: str, **labels: str) -> None:
        """Increment the counter `name` (created on first use); its label names must not vary.
        Its labelled children are kept as ``observe`` keeps them."""
        key = (name, *labels.items())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._counter_child(name, labels)
        child.inc()

    def _counter_child(self, name: str, labels: dict[str, str]) -> Counter:
        label_names = tuple(sorted(labels))
        if name not in self._counters:
            counter = Counter(name, f"kvgate counter {name}.", label_names, registry=self.registry)
            self._counters[name] = (counter, label_names)
        counter, known = self._counters[name]
        if label_names != known:
            raise ValueError(f"counter {name} has labels {known}, got {label_names}")
        return counter.labels(**labels) if labels else counter

    def gauge(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        """A gauge whose value `read()` gives at scrape time (nothing to update on the hot path)."""
        self.registry.register(_ReadGauge(name, documentation, read))

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type, for `GET /metrics`."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _ReadGauge(Collector):
    def __init__(self, name: str, documentation: str, read: Callable[[], float]) -> None:
        self._name, self._documentation, self._read = name, documentation, read

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self._name, self._documentation, value=self._read())
