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
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
from prometheus_client import Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine import AdmissionRefused, EngineOverloaded, EngineUnavailable
from engine.tokenizer import Tokenizer
from gateway.catalog.catalog import ModelFacts
from gateway.generation import (
    Completion,
    GenerationRequest,
    OffLoop,
    Stream,
    TextDelta,
    prompt_chars,
)
from gateway.ops import tracing
from gateway.ops.metrics import LATENCY_BUCKETS, Metrics
from gateway.settings import Settings
from gateway.upstream import wire
from gateway.upstream.health import Breaker
from gateway.upstream.routing import PrefixKeys, UpstreamRouter
from gateway.upstream.upstream import Upstream, UpstreamFailure, failure_of

logger = logging.getLogger("kvgate.fleet")
logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per upstream call is noise
RETRIES = 1
DEFAULT_MAX_MODEL_LEN = 32_768  # when an upstream's /v1/models does not say


class FleetConfigError(Exception):
    """The upstreams cannot be served as one fleet (none answers, or models differ)."""


class UpstreamError(RuntimeError):
    """An upstream failed a call after it had begun streaming to its client."""


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
        self._ttft = _histogram(metrics, "ttft_seconds", "Time to an upstream's first text.")
        self._latency = _histogram(
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
        call = _Call(self, request, hashes, path, body, headers)
        await call.connect()
        return _Relay(call)

    async def tokenize(self, text: str) -> list[int]:
        if self._tokenizer is not None:
            return list(await self.off_loop.run(len(text), self._tokenizer.encode, text))
        upstream, _ = self._choose([], None, set())
        try:
            response = await upstream.client.post(
                "/tokenize", json={"model": self.model_name, "prompt": text}
            )
        except httpx.TransportError as exc:
            failure = failure_of(exc, upstream.url)
            self._failed(upstream, failure)
            raise EngineUnavailable(str(failure)) from None
        if response.status_code != 200:
            raise ValueError(f"upstream /tokenize answered {response.status_code}")
        return list(response.json()["tokens"])

    # -- routing and health ------------------------------------------------------------------

    def _choose(
        self, hashes: list[bytes], cache_key: str | None, tried: set[int]
    ) -> tuple[Upstream, str]:
        available = [u.breaker.available() and u.index not in tried for u in self.upstreams]
        index, reason = self.router.choose(
            hashes, cache_key, [u.in_flight for u in self.upstreams], available
        )
        upstream = self.upstreams[index]
        self.metrics.count("kvgate_upstream_routing", upstream=str(index), reason=reason)
        return upstream, reason

    def _failed(self, upstream: Upstream, failure: UpstreamFailure) -> None:
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
            self._failed(upstream, failure)
            return
        was = upstream.breaker.healthy
        upstream.breaker.success()
        if not was and upstream.breaker.healthy:
            logger.info("upstream %s is back", upstream.url)


class _Call:
    """One call's attempts: the upstreams tried, the one streaming now, the retry left."""

    def __init__(
        self,
        fleet: Fleet,
        request: GenerationRequest,
        hashes: list[bytes],
        path: str,
        body: dict[str, Any],
        headers: dict[str, str],
    ) -> None:
        self.fleet, self.request, self.hashes = fleet, request, hashes
        self.path, self.body, self.headers = path, body, headers
        self.tried: set[int] = set()
        self.retries = RETRIES
        self.upstream: Upstream | None = None
        self.response: httpx.Response | None = None
        self.started = 0.0
        self.last: UpstreamFailure | None = None

    async def connect(self) -> None:
        """Open the stream on the best untried upstream; on failure try the next once.
        Raises AdmissionRefused when none can take it, ValueError for a 4xx."""
        fleet = self.fleet
        while True:
            try:
                upstream, _ = fleet._choose(self.hashes, self.request.cache_key, self.tried)
            except EngineUnavailable:
                if self.last is not None and self.last.kind == "overloaded":  # pass it on
                    raise EngineOverloaded(str(self.last), self.last.retry_after_s) from None
                raise
            self.tried.add(upstream.index)
            upstream.in_flight += 1
            fleet.metrics.count("kvgate_upstream_requests", upstream=str(upstream.index))
            self.started = time.perf_counter()
            try:
                self.response = await upstream.open_stream(self.path, self.body, self.headers)
            except UpstreamFailure as failure:
                upstream.in_flight -= 1
                self._retry_or_refuse(upstream, failure)
                continue
            except BaseException:
                upstream.in_flight -= 1
                raise
            self.upstream = upstream
            return

    def _retry_or_refuse(self, upstream: Upstream, failure: UpstreamFailure) -> None:
        self.fleet._failed(upstream, failure)
        self.last = failure
        if self.retries == 0:
            refusal = EngineOverloaded if failure.kind == "overloaded" else EngineUnavailable
            raise refusal(str(failure), failure.retry_after_s)
        self.retries -= 1
        self.fleet.metrics.count("kvgate_upstream_retries", upstream=str(upstream.index))

    async def relay(self) -> AsyncIterator[TextDelta | Completion]:
        sent = 0
        try:
            while True:
                try:
                    async for item in self._items():
                        if isinstance(item, TextDelta):
                            sent += 1
                        yield item
                    return
                except UpstreamFailure as failure:
                    upstream = await self._release()
                    if sent:
                        self.fleet._failed(upstream, failure)
                        raise UpstreamError(f"{failure} after {sent} chunks") from None
                    try:
                        self._retry_or_refuse(upstream, failure)
                        await self.connect()
                    except (AdmissionRefused, ValueError) as exc:
                        raise UpstreamError(str(exc)) from None
        finally:
            if self.upstream is not None:
                await self._close()

    async def _items(self) -> AsyncIterator[TextDelta | Completion]:
        """The current upstream's stream as deltas then one Completion (UpstreamFailure if it
        breaks, stalls past the read timeout, reports an error or ends early)."""
        assert self.response is not None and self.upstream is not None
        upstream, text, count, finish, usage = self.upstream, [], 0, None, None
        label = str(upstream.index)
        try:
            async for line in self.response.aiter_lines():
                chunk = wire.parse_line(line)
                if chunk is None:
                    continue
                if chunk.done:
                    break
                usage = chunk.usage or usage
                finish = chunk.finish_reason or finish
                if chunk.text:
                    if not count:
                        self.fleet._ttft.labels(label).observe(time.perf_counter() - self.started)
                    count += 1
                    text.append(chunk.text)
                    yield TextDelta(chunk.text, count, [], None)
        except httpx.TransportError as exc:
            raise failure_of(exc, upstream.url) from None
        except wire.StreamError as exc:
            raise UpstreamFailure("stream_error", f"upstream {upstream.url}: {exc}") from None
        if finish is None:
            raise UpstreamFailure("reset", f"upstream {upstream.url} ended the stream early")
        upstream.breaker.success()
        self.fleet._latency.labels(label).observe(time.perf_counter() - self.started)
        usage = usage or {}
        yield Completion(
            text="".join(text),
            finish_reason=finish,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or count),
            cached_tokens=wire.cached_tokens(usage),
            replica=upstream.index,
            upstream=upstream.url,
        )

    async def _release(self) -> Upstream:
        upstream, response = self.upstream, self.response
        assert upstream is not None and response is not None
        upstream.in_flight -= 1
        self.upstream = self.response = None
        await response.aclose()
        return upstream

    async def _close(self) -> None:
        """The call is done or abandoned: closing the response drops the connection when the
        stream is unfinished, which aborts the request upstream."""
        assert self.upstream is not None and self.response is not None
        self.upstream.in_flight -= 1
        response, self.upstream, self.response = self.response, None, None
        await response.aclose()


class _Relay:
    """A call's items; ``aclose`` releases its upstream even when it was never iterated (an
    async generator that never started would skip its ``finally``)."""

    def __init__(self, call: _Call) -> None:
        self._call = call
        self._items = call.relay()

    def __aiter__(self) -> _Relay:
        return self

    async def __anext__(self) -> TextDelta | Completion:
        return await anext(self._items)

    async def aclose(self) -> None:
        await self._items.aclose()
        if self._call.upstream is not None:
            await self._call._close()


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
