"""Fleet mode: a ``Backend`` whose calls run on upstream engine servers (vLLM, SGLang, kvgate).

A call is routed (``choice``), sent streamed over the OpenAI wire (``wire``) and relayed as
the same ``TextDelta``s and ``Completion`` the embedded engine yields (``call``), so both
front doors serve unchanged on top of it. Faults: a call that has yielded nothing yet is
retried once on the next choice on the ring (the failed upstream excluded); one that has begun
ends with ``UpstreamFailed`` (a tool error, an SSE error event), never a hang
(``upstream_read_timeout_s`` bounds every silence). With no upstream available a call is
refused like a full engine (−31000 / 503 + Retry-After); an upstream's own 429/503 is passed
on the same way when no other upstream can take the call. Closing a call's stream closes the
upstream connection, which makes vLLM and kvgate abort the request.

The parts: ``membership`` (the members, their health checks and scraped load), ``choice``
(the routing decision), ``call`` (one generation's attempts), ``proxies`` (tokenizing and
embeddings), ``fleet_metrics``; this module starts them (``Fleet.connect``: the upstreams'
``/v1/models`` asked once), runs their background work and answers as the ``Backend``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from kvgate.engine.errors import AdapterError, InvalidArgument
from kvgate.engine.loading.tokenizer_source import load_tokenizer
from kvgate.engine.tokenization.tokenizer import Tokenizer
from kvgate.gateway import redis_connection
from kvgate.gateway.auth import identity
from kvgate.gateway.calls.errors import UpstreamFailed
from kvgate.gateway.catalog.catalog import ModelFacts
from kvgate.gateway.generation import (
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
)
from kvgate.gateway.http import io as http_io
from kvgate.gateway.ops.metrics import Metrics
from kvgate.gateway.settings import Settings
from kvgate.gateway.upstream import wire
from kvgate.gateway.upstream.call import UpstreamCall
from kvgate.gateway.upstream.choice import Chooser
from kvgate.gateway.upstream.fleet_metrics import FleetMetrics
from kvgate.gateway.upstream.kv_metrics import KVEventsCollector
from kvgate.gateway.upstream.kv_subscriber import EventSource, KVSubscriber
from kvgate.gateway.upstream.members import DnsTarget, Resolver, system_resolver
from kvgate.gateway.upstream.membership import Membership, ask_all, union
from kvgate.gateway.upstream.placement import (
    Asked,
    Placements,
    follow_or_place,
    placement_key,
)
from kvgate.gateway.upstream.precise import BLOCK_SIZES, PreciseScorer, PromptBlocks
from kvgate.gateway.upstream.proxies import Proxies
from kvgate.gateway.upstream.routing import PrefixKeys
from kvgate.gateway.upstream.upstream import Upstream
from kvgate.gateway.upstream.upstream import headers as upstream_headers
from kvgate.gateway.upstream.upstream_tokens import UpstreamTokens

logger = logging.getLogger("kvgate.fleet")
DEFAULT_MAX_MODEL_LEN = 32_768  # when an upstream's /v1/models does not say


@dataclass(slots=True)
class Decision:
    """What routing reads of one call (``Fleet.decide``)."""

    hashes: list[bytes]  # the prefix keys (none when a cache_key routes)
    prompt: PromptBlocks | None  # the call's blocks, for precise routing
    placed: Upstream | None = None  # the upstream its placement record names
    asked: Asked | None = None  # a Redis read the call did not wait for (``settle``)
    key: bytes | None = None  # its placement key


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
        self.off_loop = OffLoop()
        self.observed = FleetMetrics(model_name)
        self.members = Membership(
            settings, model_name, urls, self.observed, resolve, dict(resolved or {})
        )
        self.members.start_down(down)
        self.subscriber: KVSubscriber | None = None
        precise = None
        if settings.upstream_kv_events:
            sources = [EventSource.parse(spec) for spec in settings.upstream_kv_events]
            self.subscriber = KVSubscriber(sources, settings.upstream_kv_index_blocks)
            precise = PreciseScorer(self.subscriber)
        interval = settings.upstream_scrape_interval_s
        self.chooser = Chooser(self.members, self.observed, interval, precise)
        self.upstream_tokens = None  # without --tokenizer, the upstreams' /tokenize
        if precise is not None and tokenizer is None:
            self.upstream_tokens = UpstreamTokens(
                self.chooser, model_name, max_model_len, self.off_loop
            )
        self.proxies = Proxies(self.chooser, model_name, max_model_len, tokenizer, self.off_loop)
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
            for spec in settings.upstream_kv_events:
                EventSource.parse(spec)
        except ValueError as exc:
            raise FleetConfigError(str(exc)) from None
        resolved: dict[DnsTarget, list[str]] = {}
        for target in targets:
            try:
                resolved[target] = target.urls(resolve)
            except OSError as exc:
                logger.warning("upstream-dns %s: %s; retrying every refresh", target.host, exc)
        urls = union(settings.upstream, resolved)
        if not urls:
            raise FleetConfigError(
                "no upstream: give --upstream URL or an --upstream-dns name that resolves"
            )
        _salt_secret(settings)
        key_header = upstream_headers(settings.upstream_api_key)
        timeout = settings.upstream_connect_timeout_s
        answers = asyncio.run(ask_all(urls, timeout, key_header))
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
        tokenizer_source = settings.tokenizer or settings.model
        try:
            tokenizer = load_tokenizer(tokenizer_source) if tokenizer_source else None
        except Exception as exc:  # noqa: BLE001 - any load failure is a startup error
            raise FleetConfigError(
                f"cannot load the tokenizer from {tokenizer_source}: {exc}"
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

    @property
    def upstreams(self) -> list[Upstream]:
        return self.members.upstreams

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
        return self.members.readiness()

    async def open(self, metrics: Metrics) -> None:
        self.observed.open(metrics, lambda: self.members.upstreams)
        settings, members = self.settings, self.members
        for interval, work in (
            (settings.upstream_health_interval_s, members.check_all),
            (settings.upstream_scrape_interval_s, members.scrape_all),
            (settings.upstream_refresh_s if members.targets else 0, members.refresh),
        ):
            if interval > 0:
                self._tasks.append(asyncio.create_task(_every(interval, work)))
        if self.placements is not None:
            await self.placements.connect()
        if self.subscriber is not None:
            self.subscriber.start()
            collector = KVEventsCollector(self.subscriber, lambda: self.members.upstreams)
            metrics.registry.register(collector)
        if self.token_ids is not None:  # string logprobs map back without a stall
            self._tasks.append(asyncio.create_task(asyncio.to_thread(self.token_ids.prepare)))

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.members.aclose()
        if self.subscriber is not None:
            self.subscriber.close()
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
        sent = wire.request_body(request, self.model_name)
        decision = await self.decide(request)
        headers: dict[str, str] = {}  # each attempt adds its traceparent (``attempt``)
        route, observed = self.chooser, self.observed
        hashes = decision.hashes
        call = UpstreamCall(route, observed, self.token_ids, request, hashes, (*sent, headers))
        call.prompt, call.placed = decision.prompt, decision.placed
        try:
            await call.connect()
        except UpstreamFailed as exc:  # began, and failed: the stream says so (Backend)
            return Guarded(_failed(exc), call)
        assert call.upstream is not None
        self.settle(decision, call.upstream)
        http_io.note_served_by(call.upstream.url)
        return Guarded(call.relay(), call)

    async def decide(self, request: GenerationRequest) -> Decision:
        """What the routing decision reads of a call: its prefix keys, its blocks (precise
        routing) and the upstream its placement record names. A relayed call (``start``)
        and a picked one (``pick``, ``kvgate epp``) both read it here."""
        hashes: list[bytes] = []  # a cache_key routes on its own: no prompt to hash
        prompt = None
        if self.subscriber is not None:
            ids = None
            if self.upstream_tokens is not None:
                ids = await self.upstream_tokens.token_ids(request)
            chars = prompt_chars(request)
            hashes, prompt = await self.off_loop.run(chars, self._blocks, request, ids)
        elif request.cache_key is None:
            hashes = await self.off_loop.run(prompt_chars(request), self.prefix_keys, request)
        decision = Decision(hashes, prompt)
        placements = self.placements
        decision.key = placement_key(hashes, request.cache_key, request.cache_salt)
        if placements is not None and decision.key is not None:
            own = self.chooser.own(hashes, request.cache_key)
            decision.placed, decision.asked = await follow_or_place(
                placements, decision.key, self.upstreams, self.chooser.load, own
            )
        return decision

    async def pick(self, request: GenerationRequest, excluded: set[int]) -> Upstream:
        """The upstream a call would be sent to, without sending it: the same ``decide``
        and ``Chooser.choose`` as ``start`` (``excluded``: member indices not to pick).
        Raises ``EngineUnavailable`` when none can take it."""
        decision = await self.decide(request)
        upstream = self.chooser.choose(
            decision.hashes, request.cache_key, excluded, decision.placed, decision.prompt
        )
        self.settle(decision, upstream)
        return upstream

    def settle(self, decision: Decision, upstream: Upstream) -> None:
        """Redis answered late: its record follows the upstream the call went to."""
        if decision.asked is not None:
            assert self.placements is not None and decision.key is not None
            self.placements.settle(decision.key, decision.asked, upstream.url)

    def _blocks(
        self, request: GenerationRequest, asked: list[int] | None
    ) -> tuple[list[bytes], PromptBlocks | None]:
        """Off the loop: the routing keys and, where its token ids are known (here, or
        ``asked`` of an upstream), the call's blocks with their content keys computed. The
        keys hash routing falls back on do not depend on an upstream's answer."""
        ids = self.prefix_keys.token_ids(request)
        hashes = [] if request.cache_key is not None else self.prefix_keys.of(request, ids)
        ids = asked if ids is None else ids
        if ids is None:
            return hashes, None
        prompt = PromptBlocks(ids, request.adapter, request.cache_salt)
        for block_size in BLOCK_SIZES:
            prompt.keys(block_size)
        return hashes, prompt

    def adapters(self) -> list[Adapter] | None:
        """Not known here: a call's ``model`` goes upstream as given, and its 404 comes back."""
        return None

    async def load_adapter(self, name: str, path: str, replace: bool) -> None:
        raise AdapterError("fleet mode: load LoRA adapters on the upstream servers")

    async def unload_adapter(self, name: str) -> bool:
        raise AdapterError("fleet mode: unload LoRA adapters on the upstream servers")

    async def prompt_ids(self, request: GenerationRequest) -> list[int]:
        return await self.proxies.prompt_ids(request)

    async def tokenize(self, request: TokenizeRequest) -> Tokenized:
        return await self.proxies.tokenize(request)

    async def tokenize_request(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self.proxies.tokenize_request(body)

    async def embed(self, request: EmbeddingsRequest) -> Embeddings:
        return await self.proxies.embed(request)


async def _every(interval_s: float, work: Callable[[], Awaitable[None]]) -> None:
    while True:
        try:
            await work()
        except Exception:  # noqa: BLE001 - one bad round must not end the loop
            logger.exception("fleet background work failed")
        await asyncio.sleep(interval_s)


async def _failed(error: UpstreamFailed) -> AsyncGenerator[TextDelta | Completion]:
    raise error
    yield  # an async generator


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
