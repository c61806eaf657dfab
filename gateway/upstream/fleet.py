"""Fleet mode: a ``Backend`` whose calls run on upstream engine servers (vLLM, SGLang, kvgate).

A call is routed (``routing``), sent streamed over the OpenAI wire (``wire``) and relayed as
the same ``TextDelta``s and ``Completion`` the embedded engine yields, so both front doors
serve unchanged on top of it. Faults: a call that has yielded nothing yet is retried once on
the next choice on the ring (the failed upstream excluded); one that has begun ends with
``UpstreamFailed`` (a tool error, an SSE error event), never a hang (``upstream_read_timeout_s``
bounds every silence). With no upstream available a call is refused like a full engine
(−31000 / 503 + Retry-After); an upstream's own 429/503 is passed on the same way when no
other upstream can take the call. Closing a call's stream closes the upstream connection,
which makes vLLM and kvgate abort the request.

Members: the ``--upstream`` URLs and the addresses of the ``--upstream-dns`` names, re-resolved
every ``--upstream-refresh`` seconds (``members``). A new address joins the ring once its
``/v1/models`` names the fleet's model; one gone from the answer leaves it at once, its
client closed when its last call ends. Each upstream keeps the index it was first given
(``replica`` in results, the ``upstream`` metric label). Every ``--upstream-scrape-interval``
seconds each member's ``/metrics`` is read for its queue, batch and KV usage (``scrape``),
which routing weighs with this gateway's own in-flight calls (``routing.Load``).

Tokenizing: with ``--tokenizer`` (or ``--model``) the gateway tokenizes itself; without it
``tokenize`` and ``tokenize_request`` (a vLLM ``/tokenize`` body, answered in full) ask a
healthy upstream, whose answer is checked before it is relayed. Embeddings are proxied the
same way to an upstream's ``/v1/embeddings`` (one call for all the inputs, a bounded read,
the answer's shape checked), as a client would call the upstream itself.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import asdict
from typing import Any

import orjson
from prometheus_client import Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.errors import AdapterError, EngineOverloaded, EngineUnavailable, InvalidArgument
from engine.tokenizer import Tokenizer
from gateway import redis_connection
from gateway.auth import identity
from gateway.calls.errors import BadInput, UpstreamFailed
from gateway.catalog.catalog import ModelFacts
from gateway.generation import (
    Adapter,
    Completion,
    Embeddings,
    EmbeddingsRequest,
    GenerationRequest,
    Guarded,
    OffLoop,
    Stream,
    TextDelta,
    Tokenized,
    TokenizeRequest,
    prompt_chars,
    tokenize_here,
)
from gateway.http import io as http_io
from gateway.ops import tracing
from gateway.ops.metrics import LATENCY_BUCKETS, Metrics
from gateway.settings import Settings
from gateway.upstream import bounded, embeddings, scrape, wire
from gateway.upstream.call import Call
from gateway.upstream.failures import TRANSPORT_ERRORS, AttemptFailed, Failure, transport_failure
from gateway.upstream.health import Breaker
from gateway.upstream.members import DnsTarget, Resolver, system_resolver
from gateway.upstream.placement import Placements, follow_or_place, placement_key
from gateway.upstream.routing import Load, PrefixKeys, UpstreamRouter
from gateway.upstream.upstream import Upstream
from gateway.upstream.upstream import headers as upstream_headers

logger = logging.getLogger("kvgate.fleet")
DEFAULT_MAX_MODEL_LEN = 32_768  # when an upstream's /v1/models does not say
SCRAPES_FRESH = 3  # a scrape older than this many intervals is no longer routed on
# What of a vLLM /tokenize body goes upstream (its completion and chat forms); ``model`` is
# always the fleet's.
TOKENIZE_FIELDS = (
    "prompt",
    "messages",
    "add_special_tokens",
    "return_token_strs",
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "tools",
)
# A /tokenize answer is read up to this many bytes per byte of the request (a token's id and
# text in JSON, escapes included, for each byte tokenized), plus a fixed allowance.
TOKENIZE_BYTES_PER_BYTE = 64
TOKENIZE_MIN_BYTES = 1 << 16


class FleetConfigError(Exception):
    """The upstreams cannot be served as one fleet (none answers, or models differ)."""


class Fleet:
    reads_tool_calls = True  # the upstreams render and parse them (see ``wire``)

    def __init__(
        self,
        settings: Settings,
        model_name: str,
        max_model_len: int,
        urls: list[str],
        tokenizer: Tokenizer | None = None,
        down: frozenset[str] = frozenset(),
        resolve: Resolver = system_resolver,
        resolved: dict[DnsTarget, list[str]] | None = None,
    ) -> None:
        self.settings = settings
        self.model_name = model_name
        self.max_model_len = max_model_len
        self._tokenizer = tokenizer
        self._resolve = resolve
        self._targets = [DnsTarget.parse(spec) for spec in settings.upstream_dns]
        self._resolved = dict(resolved or {})
        self.off_loop = OffLoop()
        self.metrics = Metrics()  # replaced by the app's in open()
        self._indices: dict[str, int] = {}
        self.upstreams: list[Upstream] = []
        self._draining: list[Upstream] = []
        self._set_members(urls)
        for upstream in self.upstreams:
            if upstream.url in down:  # did not answer at startup: out until a check passes
                for _ in range(settings.upstream_unhealthy_after):
                    upstream.breaker.failure(Failure.CONNECT)
        self.placements = None
        if settings.redis_url is not None and settings.routing == "prefix":
            self.placements = Placements(
                redis_connection.connect(settings.redis_url),
                settings.upstream_placement_timeout_s,
            )
        self.prefix_keys = PrefixKeys(tokenizer)
        self.token_ids = wire.TokenIds(tokenizer) if tokenizer is not None else None
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    def connect(cls, settings: Settings, resolve: Resolver = system_resolver) -> Fleet:
        """Resolve the ``--upstream-dns`` names and read every upstream's ``/v1/models``
        (FleetConfigError: a bad flag, none answers, or they serve different models); load
        ``--tokenizer`` (or ``--model``) when given."""
        try:
            targets = [DnsTarget.parse(spec) for spec in settings.upstream_dns]
        except ValueError as exc:
            raise FleetConfigError(str(exc)) from None
        resolved: dict[DnsTarget, list[str]] = {}
        for target in targets:
            try:
                resolved[target] = target.urls(resolve)
            except OSError as exc:
                logger.warning("upstream-dns %s: %s; retrying every refresh", target.host, exc)
        urls = _union(settings.upstream, resolved)
        if not urls:
            raise FleetConfigError(
                "no upstream: give --upstream URL or an --upstream-dns name that resolves"
            )
        _salt_secret(settings)
        key_header = upstream_headers(settings.upstream_api_key)
        timeout = settings.upstream_connect_timeout_s
        answers = asyncio.run(_ask_all(urls, timeout, key_header))
        models: dict[str, tuple[str, int]] = {}
        down: set[str] = set()
        for url, answer in zip(urls, answers, strict=True):
            if isinstance(answer, BaseException):
                logger.warning(
                    "upstream %s: /v1/models failed (%s); starting it as down", url, answer
                )
                down.add(url)
            else:
                models[url] = answer
        if not models:
            raise FleetConfigError(f"no upstream answered GET /v1/models: {', '.join(urls)}")
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
            urls,
            tokenizer,
            frozenset(down),
            resolve,
            resolved,
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
                "index": u.index,
                "url": u.url,
                "state": u.breaker.state,
                "in_flight": u.in_flight,
                "last_error": u.breaker.last_error,
                "scraped": None if u.scraped is None else asdict(u.scraped),
            }
            for u in self.upstreams
        ]
        return any(u.breaker.available() for u in self.upstreams), {"upstreams": states}

    async def open(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.ttft = _PerUpstream(metrics, "ttft_seconds", "Time to an upstream's first text.")
        self.latency = _PerUpstream(
            metrics, "request_duration_seconds", "Upstream call latency, to its last chunk."
        )
        metrics.registry.register(_HealthCollector(self))
        settings = self.settings
        for interval, work in (
            (settings.upstream_health_interval_s, self._check_all),
            (settings.upstream_scrape_interval_s, self._scrape_all),
            (settings.upstream_refresh_s if self._targets else 0, self.refresh),
        ):
            if interval > 0:
                self._tasks.append(asyncio.create_task(_every(interval, work)))
        if self.placements is not None:
            await self.placements.connect()
        if self.token_ids is not None:  # string logprobs map back without a stall
            self._tasks.append(asyncio.create_task(asyncio.to_thread(self.token_ids.prepare)))

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(u.aclose() for u in [*self.upstreams, *self._draining]))
        if self.placements is not None:
            await self.placements.aclose()
        self.off_loop.close()

    async def start(self, request: GenerationRequest) -> Stream:
        if request.params.logprobs is not None and self.token_ids is None:
            raise InvalidArgument(
                "logprobs: in fleet mode they need --tokenizer (or --model), to map the "
                "upstream's tokens to ids",
                "logprobs",
            )
        path, body = wire.request_body(request, self.model_name)
        hashes: list[bytes] = []  # a cache_key routes on its own: no prompt to hash
        if request.cache_key is None:
            hashes = await self.off_loop.run(prompt_chars(request), self.prefix_keys, request)
        headers: dict[str, str] = {}
        tracing.inject(headers)  # traceparent of the call's span, when tracing is on
        call = Call(self, request, hashes, path, body, headers)
        placements = self.placements
        key = placement_key(hashes, request.cache_key, request.cache_salt)
        asked = None
        if placements is not None and key is not None:
            call.placed, asked = await follow_or_place(
                placements, key, self.upstreams, self._load, self._own(hashes, request)
            )
        try:
            await call.connect()
        except UpstreamFailed as exc:  # began, and failed: the stream says so (Backend)
            return Guarded(_failed(exc), call)
        assert call.upstream is not None
        if asked is not None:  # Redis answered late: its record follows this call
            assert placements is not None and key is not None
            placements.settle(key, asked, call.upstream.url)
        http_io.note_served_by(call.upstream.url)
        return Guarded(call.relay(), call)

    def adapters(self) -> list[Adapter] | None:
        """Not known here: a call's ``model`` goes upstream as given, and its 404 comes back."""
        return None

    async def load_adapter(self, name: str, path: str, replace: bool) -> None:
        raise AdapterError("fleet mode: load LoRA adapters on the upstream servers")

    async def unload_adapter(self, name: str) -> bool:
        raise AdapterError("fleet mode: unload LoRA adapters on the upstream servers")

    async def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """A text or a conversation tokenized as ``tokenize`` does; token ids as given: the
        upstreams' vocabulary is not known here, so their own calls check them."""
        if isinstance(request.prompt, list):
            return request.prompt
        if request.messages is None:
            return (await self.tokenize(TokenizeRequest(request.prompt))).ids
        conversation = TokenizeRequest(
            messages=request.messages,
            tools=request.template_tools,
            chat_template_kwargs=request.chat_template_kwargs,
        )
        return (await self.tokenize(conversation)).ids

    async def tokenize(self, request: TokenizeRequest) -> Tokenized:
        """With a local tokenizer (``--tokenizer``) here; else by an upstream's ``/tokenize``."""
        if self._tokenizer is not None:
            tokenizer, limit = self._tokenizer, self.max_model_len
            return await self.off_loop.run(request.chars, tokenize_here, tokenizer, limit, request)
        body: dict[str, Any] = {
            "add_special_tokens": request.add_special_tokens,
            "return_token_strs": request.token_strs,
        }
        if request.messages is not None:
            body["messages"] = request.messages
            body.update((k, v) for k, v in request.template().items() if v is not None)
        else:
            body["prompt"] = request.text
        answer = await self.tokenize_request(body)
        return Tokenized(answer["tokens"], answer["token_strs"] if request.token_strs else None)

    async def tokenize_request(self, body: dict[str, Any]) -> dict[str, Any]:
        """A vLLM ``/tokenize`` body (``prompt`` or ``messages``, ``add_special_tokens``,
        ``return_token_strs``, the chat form's template fields) sent to a healthy upstream
        (``post``); its answer checked and rebuilt: ``{"count", "max_model_len", "tokens",
        "token_strs"}``."""
        sent = {"model": self.model_name, **{k: body[k] for k in TOKENIZE_FIELDS if k in body}}
        limit = TOKENIZE_MIN_BYTES + TOKENIZE_BYTES_PER_BYTE * len(orjson.dumps(sent))
        answer, where = await self.post("/tokenize", sent, limit)
        return _tokenized(answer, where)

    async def embed(self, request: EmbeddingsRequest) -> Embeddings:
        """The inputs sent to a healthy upstream's ``/v1/embeddings`` (``post``) as one call,
        floats asked for; its answer read within a bound per input and checked."""
        sent: dict[str, Any] = {
            "model": self.model_name,
            "input": request.inputs,
            "encoding_format": "float",
        }
        if request.cache_salt is not None:
            sent["cache_salt"] = request.cache_salt
        limit = embeddings.answer_limit(len(request.inputs))
        answer, where = await self.post("/v1/embeddings", sent, limit)
        return embeddings.embeddings_of(answer, len(request.inputs), where)

    async def post(self, path: str, sent: dict[str, Any], limit: int) -> tuple[bytes, str]:
        """``sent`` POSTed to ``path`` on a healthy upstream, its answer read within ``limit``
        bytes; the answer and where it came from. An upstream 4xx is ``BadInput`` (its
        message, at most 200 characters), 429/503 ``EngineOverloaded``, a transport failure
        ``EngineUnavailable`` (the upstream counted as failed), anything else
        ``UpstreamFailed``."""
        upstream, _ = self.choose([], None, set())
        try:
            response = await upstream.post(path, orjson.dumps(sent))
            try:
                answer = await bounded.read_within(response, limit)
            finally:
                response.close()
        except TRANSPORT_ERRORS as exc:
            failure = transport_failure(exc, upstream.url)
            self.failed(upstream, failure)
            raise EngineUnavailable(str(failure)) from None
        except AttemptFailed as failure:
            self.failed(upstream, failure)
            raise EngineUnavailable(str(failure)) from None
        where = f"upstream {upstream.url} {path}"
        if answer is None:
            raise UpstreamFailed(f"{where}: its answer is over {limit} bytes")
        status = response.status
        if status in (429, 503):
            retry_after = _retry_after(response.headers.get("retry-after"))
            raise EngineOverloaded(f"{where}: answered {status}", retry_after)
        if 400 <= status < 500:
            message, param = _error_of(answer)
            raise BadInput(message[:200], param)  # as a direct call would answer
        if status != 200:
            raise UpstreamFailed(f"{where} answered {status}")
        return answer, where

    # -- routing and health ------------------------------------------------------------------

    def choose(
        self,
        hashes: list[bytes],
        cache_key: str | None,
        tried: set[int],
        placed: Upstream | None = None,
    ) -> tuple[Upstream, str]:
        """The upstream for a call: the one its placement record names (``placed``) while it
        is available, untried and not pressed; else the router's choice."""
        members = self.upstreams
        max_age = SCRAPES_FRESH * self.settings.upstream_scrape_interval_s
        if placed is not None and placed.index not in tried and placed.breaker.available():
            if not placed.load(max_age).pressed:
                self.metrics.count(
                    "kvgate_upstream_routing", upstream=str(placed.index), reason="placed"
                )
                return placed, "placed"
        available = [u.breaker.available() and u.index not in tried for u in members]
        loads = [u.load(max_age) for u in members]
        position, reason = self.router.choose(hashes, cache_key, loads, available)
        upstream = members[position]
        self.metrics.count("kvgate_upstream_routing", upstream=str(upstream.index), reason=reason)
        return upstream, reason

    def _own(self, hashes: list[bytes], request: GenerationRequest) -> Upstream | None:
        """The upstream the hash gives the call's key, load aside."""
        members = self.upstreams
        available = [u.breaker.available() for u in members]
        if not any(available):
            return None
        idle = [Load(0)] * len(members)
        return members[self.router.choose(hashes, request.cache_key, idle, available)[0]]

    def _load(self, upstream: Upstream) -> int:
        return upstream.load(SCRAPES_FRESH * self.settings.upstream_scrape_interval_s).total

    def failed(self, upstream: Upstream, failure: AttemptFailed) -> None:
        if failure.breaks:
            was = upstream.breaker.healthy
            upstream.breaker.failure(failure.kind)
            if was and not upstream.breaker.healthy:
                logger.warning("upstream %s is out: %s", upstream.url, failure)
        self.metrics.count(
            "kvgate_upstream_errors", upstream=str(upstream.index), kind=failure.kind
        )

    async def _check_all(self) -> None:
        await asyncio.gather(*(self._check(u) for u in self.upstreams))

    async def _check(self, upstream: Upstream) -> None:
        settings = self.settings
        try:
            await upstream.check(settings.upstream_health_path, settings.upstream_health_timeout_s)
        except AttemptFailed as failure:
            self.failed(upstream, failure)
            return
        was = upstream.breaker.healthy
        upstream.breaker.success()
        if not was and upstream.breaker.healthy:
            logger.info("upstream %s is back", upstream.url)

    # -- scraped load ------------------------------------------------------------------------

    async def _scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(u) for u in self.upstreams))

    async def _scrape(self, upstream: Upstream) -> None:
        """Its ``/metrics`` load figures; a failed or invalid scrape leaves it with none (so
        it is routed on this gateway's in-flight count alone) and is counted."""
        label = str(upstream.index)
        try:
            text = await upstream.get_text(
                "/metrics", self.settings.upstream_health_timeout_s, bounded.MAX_METRICS_BYTES
            )
            scraped, invalid = scrape.parse(text)
        except AttemptFailed:
            upstream.observe(None)
            self.metrics.count("kvgate_upstream_scrape_errors", upstream=label, kind="http")
            return
        except scrape.ScrapeError as exc:
            upstream.observe(None)
            logger.warning("upstream %s: /metrics: %s", upstream.url, exc)
            self.metrics.count("kvgate_upstream_scrape_errors", upstream=label, kind="parse")
            return
        if invalid:
            self.metrics.count("kvgate_upstream_scrape_errors", upstream=label, kind="invalid")
        upstream.observe(scraped)

    # -- membership --------------------------------------------------------------------------

    def _set_members(self, urls: list[str]) -> None:
        """The ring's members become ``urls``: new ones get the next index (or the one they
        had before), departed ones drain."""
        known = {u.url: u for u in self.upstreams}
        members = []
        for url in urls:
            upstream = known.pop(url, None)
            if upstream is None:
                index = self._indices.setdefault(url, len(self._indices))
                upstream = self._upstream(index, url)
                if self.upstreams:
                    logger.info("upstream %s joined (index %d)", url, index)
                    self._membership("joined")
            members.append(upstream)
        for upstream in known.values():
            logger.info("upstream %s left", upstream.url)
            self._membership("left")
            self._draining.append(upstream)
        self.upstreams = sorted(members, key=lambda u: u.index)
        self.router = UpstreamRouter([u.url for u in self.upstreams], self.settings.routing)

    def _upstream(self, index: int, url: str) -> Upstream:
        settings = self.settings
        breaker = Breaker(
            settings.upstream_unhealthy_after,
            settings.upstream_healthy_after,
            settings.upstream_cooldown_s,
        )
        return Upstream(
            index,
            url,
            breaker,
            settings.upstream_connect_timeout_s,
            settings.upstream_read_timeout_s,
            settings.upstream_api_key,
        )

    def _membership(self, event: str) -> None:
        self.metrics.count("kvgate_upstream_membership", event=event)

    async def refresh(self) -> None:
        """Re-resolve the ``--upstream-dns`` names: addresses that appeared join once they
        serve the fleet's model, those gone leave. A name that fails keeps what it had."""
        for target in self._targets:
            try:
                self._resolved[target] = await asyncio.to_thread(target.urls, self._resolve)
            except OSError as exc:
                logger.warning(
                    "upstream-dns %s: %s; keeping its %d upstream(s)",
                    target.host,
                    exc,
                    len(self._resolved.get(target, ())),
                )
                self.metrics.count("kvgate_upstream_dns_errors")
        wanted = _union(self.settings.upstream, self._resolved)
        current = {u.url for u in self.upstreams}
        joining = [url for url in wanted if url not in current]
        verdicts = await asyncio.gather(*(self._serves_our_model(url) for url in joining))
        admitted = {url for url, ok in zip(joining, verdicts, strict=True) if ok}
        self._set_members([url for url in wanted if url in current or url in admitted])
        drained = [u for u in self._draining if u.in_flight == 0]
        self._draining = [u for u in self._draining if u.in_flight > 0]
        await asyncio.gather(*(u.aclose() for u in drained))

    async def _serves_our_model(self, url: str) -> bool:
        """May a new address join: does its ``/v1/models`` name the fleet's model?"""
        timeout = self.settings.upstream_connect_timeout_s
        key_header = upstream_headers(self.settings.upstream_api_key)
        try:
            name, _ = await _served_model(url, timeout, key_header)
        except PROBE_ERRORS as exc:
            logger.info("upstream %s is not serving yet (%s)", url, exc)
            return False
        if name != self.model_name:
            logger.warning("upstream %s serves %r, not %r: not joined", url, name, self.model_name)
            self._membership("refused")
            return False
        return True


async def _every(interval_s: float, work: Callable[[], Awaitable[None]]) -> None:
    while True:
        try:
            await work()
        except Exception:  # noqa: BLE001 - one bad round must not end the loop
            logger.exception("fleet background work failed")
        await asyncio.sleep(interval_s)


def _union(static: tuple[str, ...], resolved: dict[DnsTarget, list[str]]) -> list[str]:
    """Every member URL once: the configured ones first, then the resolved ones."""
    return list(dict.fromkeys([*static, *(url for urls in resolved.values() for url in urls)]))


async def _failed(error: UpstreamFailed) -> AsyncGenerator[TextDelta | Completion]:
    raise error
    yield  # an async generator


def _retry_after(value: str | None) -> float:
    try:
        return max(float(value or 1), 0.0)
    except ValueError:
        return 1.0


def _error_of(answer: bytes) -> tuple[str, str | None]:
    """An OpenAI-shaped error body's message and ``param`` (vLLM writes either
    ``{"error": {...}}`` or the error object itself); any other body as text."""
    try:
        body = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return answer.decode(errors="replace").strip() or "no message", None
    error = body.get("error", body) if isinstance(body, dict) else body
    if not isinstance(error, dict):
        return str(error), None
    message = error.get("message") or error.get("detail") or error
    param = error.get("param")
    field = param if isinstance(param, str) and 0 < len(param) <= 64 else None
    return (message if isinstance(message, str) else str(message)), field


def _tokenized(answer: bytes, where: str) -> dict[str, Any]:
    """A ``/tokenize`` answer's four fields, each of the type vLLM gives it (UpstreamFailed
    for anything else)."""
    try:
        body = orjson.loads(answer)
    except orjson.JSONDecodeError:
        raise UpstreamFailed(f"{where}: its answer is not JSON: {answer[:200]!r}") from None
    if not isinstance(body, dict):
        raise UpstreamFailed(f"{where}: its answer is not an object")
    tokens, count, max_model_len = body.get("tokens"), body.get("count"), body.get("max_model_len")
    strs = body.get("token_strs")
    problem = None
    if not (isinstance(tokens, list) and all(_natural(t) for t in tokens)):
        problem = "'tokens' is not a list of token ids"
    elif not (_natural(count) and count == len(tokens)):
        problem = "'count' is not the number of tokens"
    elif not (isinstance(max_model_len, int) and _natural(max_model_len) and max_model_len > 0):
        problem = "'max_model_len' is not a positive integer"
    elif strs is not None and not (
        isinstance(strs, list)
        and len(strs) == len(tokens)
        and all(isinstance(t, str) for t in strs)
    ):
        problem = "'token_strs' is not null or a string for each token"
    if problem is not None:
        raise UpstreamFailed(f"{where}: malformed answer: {problem}")
    return {"count": count, "max_model_len": max_model_len, "tokens": tokens, "token_strs": strs}


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# What asking an address which model it serves may fail with: the transport, or an answer
# that is not a /v1/models one.
PROBE_ERRORS = (*TRANSPORT_ERRORS, ValueError, KeyError, IndexError, TypeError)


async def _served_model(url: str, timeout_s: float, key_header: dict[str, str]) -> tuple[str, int]:
    """(model id, max_model_len or 0) from the address's ``/v1/models`` (``PROBE_ERRORS``)."""
    entry = (await bounded.models(url, timeout_s, key_header))["data"][0]
    return str(entry["id"]), int(entry.get("max_model_len") or 0)


async def _ask_all(
    urls: list[str], timeout_s: float, key_header: dict[str, str]
) -> list[tuple[str, int] | BaseException]:
    """Each address's served model, or what asking it failed with, all asked at once."""
    asked = [_served_model(url, timeout_s, key_header) for url in urls]
    answers = await asyncio.gather(*asked, return_exceptions=True)
    for answer in answers:
        if isinstance(answer, BaseException) and not isinstance(answer, PROBE_ERRORS):
            raise answer
    return answers


def _salt_secret(settings: Settings) -> None:
    """Key the tenant salts sent upstream with ``--tenant-salt-secret-file`` (or
    ``KVGATE_TENANT_SALT_SECRET``); without one each process draws its own, so tenants'
    prefixes are not shared across gateways (or restarts) — said once, where tenants exist."""
    try:
        secret = identity.read_salt_secret(
            settings.tenant_salt_secret_file, settings.tenant_salt_secret
        )
    except ValueError as exc:
        raise FleetConfigError(str(exc)) from None
    if secret is not None:
        identity.set_salt_secret(secret)
    elif settings.api_key or settings.api_keys_file or settings.oauth_issuer:
        logger.warning(
            "no --tenant-salt-secret-file: tenant salts are keyed with a secret of this "
            "process's own, so a tenant's cached prefixes are not shared with other gateways "
            "(give every gateway the same secret file)"
        )


class _HealthCollector(Collector):
    """``kvgate_upstream_healthy{upstream, url}``: 1 while routable, read at scrape time."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "kvgate_upstream_healthy",
            "1 while the upstream is routable (breaker closed or due a trial).",
            labels=["upstream", "url"],
        )
        for u in self._fleet.upstreams:
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
