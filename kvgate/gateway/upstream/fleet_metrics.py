"""What the fleet counts and times, per upstream and model: one object the membership, the
routing decision and the calls share, bound to the app's registry when the fleet opens (a
fresh ``Metrics`` until then, so a fleet used without an app counts into nothing anyone reads).

Each attempt on an upstream ends once (``attempt``), counted in
``kvgate_upstream_requests_total{upstream, model, outcome}``; a finished one adds the
upstream's own usage to ``kvgate_upstream_prompt_tokens_total`` and
``kvgate_upstream_generation_tokens_total{upstream, model}``, and its times to
``kvgate_upstream_time_to_first_token_seconds`` and
``kvgate_upstream_e2e_request_latency_seconds{upstream, model}``, histograms with vLLM's
buckets for its own ``vllm:`` names, so a dashboard reads both alike.
``kvgate_upstream_healthy{upstream, url}`` is read from the members at scrape time; the rest
are counters (``count``).

``model`` is what the call asked for (the fleet's model or a LoRA adapter's name) once some
upstream has answered it with a 200, else ``other``: a client's made-up names never become
series, and at most ``MAX_MODELS`` do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.engine.core.serving_stats import REQUEST_LATENCY_BUCKETS, TIME_TO_FIRST_TOKEN_BUCKETS
from kvgate.gateway.ops.metrics import Metrics
from kvgate.gateway.upstream.upstream import Upstream

MAX_MODELS = 64  # model label values: the fleet's model and the adapters upstreams serve
OTHER_MODEL = "other"
Family = TypeVar("Family", Counter, Histogram)


class FleetMetrics:
    def __init__(self, model_name: str = "") -> None:
        self._models = {model_name}
        self.bind(Metrics())

    def bind(self, metrics: Metrics) -> None:
        self.metrics = metrics
        registry = metrics.registry
        self.requests = _Children(
            Counter(
                "kvgate_upstream_requests",
                "Attempts on an upstream by how they ended: ok, refused (a 4xx: the caller's "
                "input), cancelled (the client left first), or the failure's kind.",
                ["upstream", "model", "outcome"],
                registry=registry,
            )
        )
        self.prompt_tokens, self.generation_tokens = (
            _Children(
                Counter(
                    f"kvgate_upstream_{kind}_tokens",
                    f"{kind.capitalize()} tokens of finished attempts, as the upstream's usage "
                    "says.",
                    ["upstream", "model"],
                    registry=registry,
                )
            )
            for kind in ("prompt", "generation")
        )
        self.ttft = _Children(
            Histogram(
                "kvgate_upstream_time_to_first_token_seconds",
                "Time from sending an attempt to the upstream's first text.",
                ["upstream", "model"],
                buckets=TIME_TO_FIRST_TOKEN_BUCKETS,
                registry=registry,
            )
        )
        self.e2e = _Children(
            Histogram(
                "kvgate_upstream_e2e_request_latency_seconds",
                "Time from sending an attempt to the upstream's last chunk, when it finished.",
                ["upstream", "model"],
                buckets=REQUEST_LATENCY_BUCKETS,
                registry=registry,
            )
        )

    def open(self, metrics: Metrics, members: Callable[[], Sequence[Upstream]]) -> None:
        """Count into the app's ``metrics`` from now on; ``members``: the upstreams now."""
        self.bind(metrics)
        metrics.registry.register(_HealthCollector(members))

    def count(self, name: str, **labels: str) -> None:
        self.metrics.count(name, **labels)

    def model(self, asked: str) -> str:
        """The ``model`` label of a call that asked for ``asked``."""
        return asked if asked in self._models else OTHER_MODEL

    def served(self, model: str) -> None:
        """An upstream answered ``model`` with a 200: a label of its own from now on."""
        if len(self._models) < MAX_MODELS:
            self._models.add(model)


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


class _Children(Generic[Family]):
    """A labelled family, its children kept: ``labels()`` validates and locks on every call,
    several times per proxied call."""

    def __init__(self, family: Family) -> None:
        self._family: Family = family
        self._children: dict[tuple[str, ...], Family] = {}

    def of(self, *labels: str) -> Family:
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self._family.labels(*labels)
        return child
