"""Prometheus metrics: kvgate request counters plus vLLM-named engine gauges.

Each app owns a private `CollectorRegistry`, so tests (and embedders) can build several apps in
one process without metric-name clashes. Engine figures are read at scrape time by a custom
collector rather than pushed on every step, so the hot path pays nothing for them. The engine
series use the names vLLM exports, so inference routers (llm-d, the Gateway API inference
extension) can scrape a kvgate pod as if it were a vLLM pod.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from engine.stats import EngineStats, ReplicaStats

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


class EngineCollector(Collector):
    """Turns one `engine.stats()` snapshot into vLLM-compatible metric families per scrape.

    The `vllm:*` load gauges carry only `model_name` (one series per pod, like a single-engine
    vLLM), so a router reading them gets the pod's total; per-replica figures go to separate
    `kvgate_replica_*` families with a `replica` label rather than mixing label sets in one family.
    """

    def __init__(self, engine_stats: Callable[[], EngineStats], model_name: str) -> None:
        self._engine_stats = engine_stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self._engine_stats()
        for kind, name, documentation, field in ENGINE_SERIES:
            family = kind(name, documentation, labels=["model_name"])
            family.add_metric([self._model_name], getattr(stats, field))
            yield family
        yield self._cache_config(stats)
        yield from self._per_replica(stats.per_replica)

    def _cache_config(self, stats: EngineStats) -> Metric:
        labels = {
            "block_size": str(stats.block_size),
            "num_gpu_blocks": str(stats.num_blocks),
            "cache_dtype": stats.cache_dtype,
            "enable_prefix_caching": str(stats.enable_prefix_caching),
        }
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(labels),
        )
        info.add_metric(list(labels.values()), 1)
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
