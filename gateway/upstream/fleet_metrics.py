"""What the fleet counts and times, per upstream: one object the membership, the routing
decision and the calls share, bound to the app's registry when the fleet opens (a fresh
``Metrics`` until then, so a fleet used without an app counts into nothing anyone reads).

``kvgate_upstream_ttft_seconds`` and ``kvgate_upstream_request_duration_seconds`` are
histograms labelled by upstream; ``kvgate_upstream_healthy{upstream, url}`` is read from the
members at scrape time; the rest are counters (``count``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.ops.metrics import LATENCY_BUCKETS, Metrics
from gateway.upstream.upstream import Upstream


class FleetMetrics:
    def __init__(self) -> None:
        self.bind(Metrics())

    def bind(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.ttft = _PerUpstream(metrics, "ttft_seconds", "Time to an upstream's first text.")
        self.latency = _PerUpstream(
            metrics, "request_duration_seconds", "Upstream call latency, to its last chunk."
        )

    def open(self, metrics: Metrics, members: Callable[[], Sequence[Upstream]]) -> None:
        """Count into the app's ``metrics`` from now on; ``members``: the upstreams now."""
        self.bind(metrics)
        metrics.registry.register(_HealthCollector(members))

    def count(self, name: str, **labels: str) -> None:
        self.metrics.count(name, **labels)


class _HealthCollector(Collector):
    """``kvgate_upstream_healthy{upstream, url}``: 1 while routable, read at scrape time."""

    def __init__(self, members: Callable[[], Sequence[Upstream]]) -> None:
        self._members = members

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "kvgate_upstream_healthy",
            "1 while the upstream is routable (breaker closed or due a trial).",
            labels=["upstream", "url"],
        )
        for u in self._members():
            family.add_metric([str(u.index), u.url], float(u.breaker.available()))
        yield family


class _PerUpstream:
    """A histogram labelled by upstream, its children kept: ``labels()`` validates and locks
    on every call, twice per proxied call."""

    def __init__(self, metrics: Metrics, name: str, documentation: str) -> None:
        self._histogram = Histogram(
            f"kvgate_upstream_{name}",
            documentation,
            ["upstream"],
            buckets=LATENCY_BUCKETS,
            registry=metrics.registry,
        )
        self._children: dict[int, Histogram] = {}

    def observe(self, upstream: int, seconds: float) -> None:
        child = self._children.get(upstream)
        if child is None:
            child = self._children[upstream] = self._histogram.labels(str(upstream))
        child.observe(seconds)
