"""Fleet mode: a ``Backend`` whose calls run on upstream engine servers (vLLM, SGLang, kvgate).

A call is routed (``routing``), sent streamed over the OpenAI wire (``wire``) and relayed as
the same ``TextDelta``s and ``Completion`` the embedded engine yields, so both front doors
serve unchanged on top of it. Faults: a call that has yielded nothing yet is retried once on
the next choice on the ring (the failed upstream excluded); one that has begun ends with
``UpstreamError`` (a tool error, an SSE error event), never a hang (``upstream_read_timeout_s``
bounds every silence). With no upstream available a call is refused like a full engine
(−31000 / 503 + Retry-After); an upstream's own 429/503 is passed on the same way when no
other upstream can take the call. Closing a call's stream closes the upstream connection,
which makes vLLM and kvgate abort the request.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import httpx
from prometheus_client import Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine import EngineUnavailable
from engine.tokenizer import Tokenizer
from gateway.catalog.catalog import ModelFacts
from gateway.generation import (
    GenerationRequest,
    OffLoop,
    Stream,
    encode_within,
    prompt_chars,
)
from gateway.ops import tracing
from gateway.ops.metrics import LATENCY_BUCKETS, Metrics
from gateway.settings import Settings
from gateway.upstream import wire
from gateway.upstream.call import Call, Relay
from gateway.upstream.health import Breaker
from gateway.upstream.routing import PrefixKeys, UpstreamRouter
from gateway.upstream.upstream import Upstream, UpstreamFailure, failure_of

logger = logging.getLogger("kvgate.fleet")
logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per upstream call is noise
DEFAULT_MAX_MODEL_LEN = 32_768  # when an upstream's /v1/models does not say


class FleetConfigError(Exception):
    """The upstreams cannot be served as one fleet (none answers, or models differ)."""


class Fleet:
    def __init__(
        self,
        settings: Settings,
        model_name: str,
        max_model_len: int,
        tokenizer: Tokenizer | None = None,
        down: frozenset[int] = frozenset(),
    ) -> None:
        self.settings = settings
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._tokenizer = tokenizer
        self.off_loop = OffLoop()
        self.upstreams = [
            Upstream(
                i,
                url,
                Breaker(
                    settings.upstream_unhealthy_after,
                    settings.upstream_healthy_after,
                    settings.upstream_cooldown_s,
                ),
                settings.upstream_connect_timeout_s,
                settings.upstream_read_timeout_s,
            )
            for i, url in enumerate(settings.upstream)
        ]
        for i in down:  # did not answer at startup: out until a check passes
            for _ in range(settings.upstream_unhealthy_after):
                self.upstreams[i].breaker.failure("connect")
        self.router = UpstreamRouter(len(self.upstreams), settings.routing)
        self.prefix_keys = PrefixKeys(tokenizer)
        self.metrics = Metrics()  # replaced by the app's in open()
        self._checker: asyncio.Task[None] | None = None

    @classmethod
    def connect(cls, settings: Settings) -> Fleet:
        """Read every upstream's ``/v1/models`` (FleetConfigError: none answers, or they
        serve different models); load ``--tokenizer`` (or ``--model``) when given."""
        models: dict[str, tuple[str, int]] = {}
        down: set[int] = set()
        for i, url in enumerate(settings.upstream):
            try:
                response = httpx.get(
                    url + "/v1/models", timeout=settings.upstream_connect_timeout_s
                )
                response.raise_for_status()
                entry = response.json()["data"][0]
                models[url] = (entry["id"], int(entry.get("max_model_len") or 0))
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                logger.warning("upstream %s: /v1/models failed (%s); starting it as down", url, exc)
                down.add(i)
        if not models:
            raise FleetConfigError(
                f"no upstream answered GET /v1/models: {', '.join(settings.upstream)}"
            )
        names = {name for name, _ in models.values()}
        if len(names) > 1:
            served = ", ".join(f"{url} serves {name!r}" for url, (name, _) in models.items())
            raise FleetConfigError(f"upstreams serve different models: {served}")
        lengths = [length for _, length in models.values() if length]
        tokenizer_dir = settings.tokenizer or settings.model
        try:
            tokenizer = Tokenizer.from_dir(tokenizer_dir) if tokenizer_dir else None
        except Exception as exc:  # noqa: BLE001 - any load failure is a startup error
            raise FleetConfigError(
                f"cannot load the tokenizer from {tokenizer_dir}: {exc}"
            ) from exc
        return cls(
            settings,
            names.pop(),
            min(lengths) if lengths else DEFAULT_MAX_MODEL_LEN,
            tokenizer,
            frozenset(down),
        )

    # -- Backend -----------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    @property
    def default_sampling_fields(self) -> dict[str, Any]:
        return {}  # the upstreams apply their own generation_config defaults

    @property
    def stats(self) -> None:
        return None

    def facts(self, replicas: int) -> ModelFacts:
        return ModelFacts(
            self.model_name, self.max_model_len, 0, 0, "upstream", len(self.upstreams)
        )

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        states = [
            {
                "url": u.url,
                "state": u.breaker.state,
                "in_flight": u.in_flight,
                "last_error": u.breaker.last_error,
            }
            for u in self.upstreams
        ]
        return any(u.breaker.available() for u in self.upstreams), {"upstreams": states}

    async def open(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.ttft = _histogram(metrics, "ttft_seconds", "Time to an upstream's first text.")
        self.latency = _histogram(
            metrics, "request_duration_seconds", "Upstream call latency, to its last chunk."
        )
        metrics.registry.register(_HealthCollector(self.upstreams))
        if self.settings.upstream_health_interval_s > 0:
            self._checker = asyncio.create_task(self._check_forever())

    async def aclose(self) -> None:
        if self._checker is not None:
            self._checker.cancel()
            await asyncio.gather(self._checker, return_exceptions=True)
        await asyncio.gather(*(u.aclose() for u in self.upstreams))
        self.off_loop.close()

    async def start(self, request: GenerationRequest) -> Stream:
        path, body = wire.request_body(request, self.model_name)
        hashes = await self.off_loop.run(prompt_chars(request), self.prefix_keys, request)
        headers: dict[str, str] = {}
        tracing.inject(headers)  # traceparent of the call's span, when tracing is on
        call = Call(self, request, hashes, path, body, headers)
        await call.connect()
        return Relay(call)

    async def tokenize(self, text: str) -> list[int]:
        if self._tokenizer is not None:
            tokenizer, limit = self._tokenizer, self.max_model_len
            return await self.off_loop.run(len(text), encode_within, tokenizer, limit, text)
        upstream, _ = self.choose([], None, set())
        try:
            response = await upstream.client.post(
                "/tokenize", json={"model": self.model_name, "prompt": text}
            )
        except httpx.TransportError as exc:
            failure = failure_of(exc, upstream.url)
            self.failed(upstream, failure)
            raise EngineUnavailable(str(failure)) from None
        if response.status_code != 200:
            raise ValueError(f"upstream /tokenize answered {response.status_code}")
        return list(response.json()["tokens"])

    # -- routing and health ------------------------------------------------------------------

    def choose(
        self, hashes: list[bytes], cache_key: str | None, tried: set[int]
    ) -> tuple[Upstream, str]:
        available = [u.breaker.available() and u.index not in tried for u in self.upstreams]
        index, reason = self.router.choose(
            hashes, cache_key, [u.in_flight for u in self.upstreams], available
        )
        upstream = self.upstreams[index]
        self.metrics.count("kvgate_upstream_routing", upstream=str(index), reason=reason)
        return upstream, reason

    def failed(self, upstream: Upstream, failure: UpstreamFailure) -> None:
        if failure.breaks:
            was = upstream.breaker.healthy
            upstream.breaker.failure(failure.kind)
            if was and not upstream.breaker.healthy:
                logger.warning("upstream %s is out: %s", upstream.url, failure)
        self.metrics.count(
            "kvgate_upstream_errors", upstream=str(upstream.index), kind=failure.kind
        )

    async def _check_forever(self) -> None:
        settings = self.settings
        while True:
            await asyncio.gather(*(self._check(u) for u in self.upstreams))
            await asyncio.sleep(settings.upstream_health_interval_s)

    async def _check(self, upstream: Upstream) -> None:
        settings = self.settings
        try:
            await upstream.check(settings.upstream_health_path, settings.upstream_health_timeout_s)
        except UpstreamFailure as failure:
            self.failed(upstream, failure)
            return
        was = upstream.breaker.healthy
        upstream.breaker.success()
        if not was and upstream.breaker.healthy:
            logger.info("upstream %s is back", upstream.url)


class _HealthCollector(Collector):
    """``kvgate_upstream_healthy{upstream, url}``: 1 while routable, read at scrape time."""

    def __init__(self, upstreams: list[Upstream]) -> None:
        self._upstreams = upstreams

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "kvgate_upstream_healthy",
            "1 while the upstream is routable (breaker closed or due a trial).",
            labels=["upstream", "url"],
        )
        for u in self._upstreams:
            family.add_metric([str(u.index), u.url], float(u.breaker.available()))
        yield family


def _histogram(metrics: Metrics, name: str, documentation: str) -> Histogram:
    return Histogram(
        f"kvgate_upstream_{name}",
        documentation,
        ["upstream"],
        buckets=LATENCY_BUCKETS,
        registry=metrics.registry,
    )
