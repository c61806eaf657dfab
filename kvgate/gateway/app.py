"""The Starlette application: the MCP endpoint plus health, readiness and metrics.

The engine is built by the caller (CLI or test) and handed in, so one engine can back several
apps in tests and its lifetime stays with whoever created it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, Router
from starlette.types import ASGIApp, Receive, Scope, Send

from kvgate.gateway.adapters import runtime_updating
from kvgate.gateway.admin import admin_routes
from kvgate.gateway.auth.authenticator import Authenticator
from kvgate.gateway.auth.budgets import Budgets
from kvgate.gateway.auth.challenge import Challenge
from kvgate.gateway.auth.middleware import AuthMiddleware, plain
from kvgate.gateway.calls.generations import Generations
from kvgate.gateway.calls.lifecycle import Lifecycle
from kvgate.gateway.catalog.catalog import Catalog, CatalogHolder, ModelFacts
from kvgate.gateway.catalog.config import CatalogConfig, CatalogConfigError, load_catalog_config
from kvgate.gateway.catalog.discovery_cache import DiscoveryCache, EventHook
from kvgate.gateway.catalog.reload import CatalogReloader
from kvgate.gateway.console.routes import console_routes
from kvgate.gateway.embedded import EngineBackend
from kvgate.gateway.function_calls import formats as tool_formats
from kvgate.gateway.generation import Backend
from kvgate.gateway.http.probes import probe_routes
from kvgate.gateway.http.security import HostOriginGuard, OriginPolicy
from kvgate.gateway.http.trim import TrimAfterLargeBodies
from kvgate.gateway.mcp.endpoint import McpEndpoint
from kvgate.gateway.mcp.errors import protocol_error
from kvgate.gateway.mcp.tool_runner import ToolRunner
from kvgate.gateway.openai.endpoint import OpenAIEndpoint
from kvgate.gateway.openai.errors import wire as openai_error
from kvgate.gateway.openai.response_store import ResponseStore
from kvgate.gateway.ops.access_log import AccessLog
from kvgate.gateway.ops.metrics import Metrics
from kvgate.gateway.reasoning import parser as reasoning_formats
from kvgate.gateway.settings import Settings
from kvgate.gateway.tasks.store import MemoryTaskStore, TaskStore
from kvgate.gateway.tasks.tasks import Tasks
from kvgate.protocol import jsonrpc

MCP_PATH = "/mcp"
GRAMMAR_GAUGES = {  # EngineStats fields (0 where an engine does not count them)
    "grammar_cache_bytes": "Memory of the compiled grammars the engine keeps for reuse.",
    "grammar_cache_limit_bytes": "The bound on kvgate_grammar_cache_bytes.",
    "grammar_cache_entries": "Compiled grammars the engine keeps for reuse.",
    "max_grammar_bytes": "The largest structured-output spec the engine compiles.",
}
# A proxied call allocates a few thousand objects, nearly none of them in cycles: collecting
# the young generation every 700 allocations (CPython's default) cost ~7% of a fleet call's
# CPU on benchmarks/fleet.py's overhead workload; every 10,000 it is noise (10k-200k measured
# alike), and the memory a cycle may hold until then stays small.
GC_THRESHOLDS = (10_000, 50, 100)
log = logging.getLogger(__name__)


def build_catalog(facts: ModelFacts, settings: Settings) -> Catalog:
    """The catalog for the model and the config file as it is now (CatalogConfigError if bad)."""
    config = (
        load_catalog_config(settings.catalog_config) if settings.catalog_config else CatalogConfig()
    )
    instructions = settings.instructions if config.instructions is None else config.instructions
    return Catalog(facts, settings.server_name, instructions, settings.catalog_ttl_ms, config)


def make_discovery_cache(
    redis_url: str | None,
    *,
    near_cache_size: int = 256,
    ttl_s: float = 300,
    timeout_s: float = 0.05,
    on_event: EventHook | None = None,
) -> DiscoveryCache:
    """A Redis-backed cache for ``redis_url``, else the in-process one (same interface)."""
    options = dict(
        near_cache_size=near_cache_size, ttl_s=ttl_s, timeout_s=timeout_s, on_event=on_event
    )
    if redis_url is None:
        return DiscoveryCache(**options)  # type: ignore[arg-type]
    from kvgate.gateway.catalog.redis_cache import (
        RedisDiscoveryCache,  # imports redis only when asked
    )

    return RedisDiscoveryCache(redis_url, **options)  # type: ignore[arg-type]


def make_task_store(redis_url: str | None) -> TaskStore:
    """The Redis store for ``redis_url`` (every process answers), else the in-process one."""
    if redis_url is None:
        return MemoryTaskStore()
    from kvgate.gateway.tasks.redis_store import RedisTaskStore  # imports redis only when asked

    return RedisTaskStore(redis_url)


def create_app(
    settings: Settings,
    engine: Any = None,
    *,
    backend: Backend | None = None,
    created: int | None = None,
) -> Starlette:
    """The app over the embedded ``engine``, or over another ``backend`` (a fleet);
    ``created``: the model's time in ``/v1/models`` (default: now)."""
    backend = backend if backend is not None else EngineBackend(engine)
    metrics = Metrics(backend.stats, backend.model_name)
    facts = backend.facts(settings.replicas)
    catalog = build_catalog(facts, settings)

    def on_cache_event(event: str) -> None:
        if event != "near_hit":  # the hot path's own event stays off it (cache.stats has it)
            metrics.count("kvgate_discovery_cache_events", event=event)

    cache = make_discovery_cache(settings.redis_url, on_event=on_cache_event)
    served = CatalogHolder(catalog)
    reloader = CatalogReloader(served, cache, lambda: build_catalog(facts, settings), metrics)
    tokenizer = backend.tokenizer
    templates = None if tokenizer is None else tokenizer.chat_template
    budgets = Budgets(
        settings.budget_requests_per_min,
        settings.budget_tokens_per_min,
        settings.redis_url,
        settings.budget_processes,
    )
    family = tool_formats.resolve(settings.tool_call_parser, templates)
    reasoning = reasoning_formats.resolve(settings.reasoning_parser)
    generations = Generations(backend, budgets, family, reasoning)
    calls = Lifecycle(settings, budgets)  # both doors: one client counter, one set of budgets
    tasks = Tasks(settings, make_task_store(settings.redis_url), metrics, backend.stats)
    tools = ToolRunner(generations, tasks.estimate.observe)  # calls' pace: the task rule's
    endpoint = McpEndpoint(settings, served, tools, cache, metrics, reloader.versions, calls, tasks)
    model = settings.served_model_name or backend.model_name
    store = None
    if settings.redis_url is not None:  # /v1/responses' store: true and previous_response_id
        store = ResponseStore(settings.redis_url, settings.responses_ttl_s)
    lora_updates = runtime_updating(settings)
    openai = OpenAIEndpoint(generations, model, metrics, calls, store, lora_updates, created)
    authenticator = Authenticator(settings, openai.inference_paths)

    def challenge_body(path: str, challenge: Challenge) -> bytes:
        """A refused credential in the words of the door ``path`` belongs to."""
        if path == MCP_PATH:
            return jsonrpc.encode_error(protocol_error(challenge))
        if openai.owns(path):
            return openai_error(challenge).encode()
        return plain(path, challenge)

    metrics.gauge(
        "kvgate_discovery_cache_degraded",
        "1 while Redis is unreachable and discovery is answered by this process alone.",
        lambda: float(cache.degraded),
    )
    engine_stats = backend.stats
    if engine_stats is not None:  # the compiled-grammar cache's memory against its bound
        for field, documentation in GRAMMAR_GAUGES.items():
            metrics.gauge(
                f"kvgate_{field}",
                documentation,
                lambda field=field: float(getattr(engine_stats(), field, 0)),  # type: ignore[misc]
            )
    loop: asyncio.AbstractEventLoop | None = None

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        """The backend's readiness (every replica stepping; a fleet: some upstream healthy)."""
        ready, details = backend.readiness()
        ready = ready and not app.state.draining
        return JSONResponse({"ready": ready, **details}, status_code=200 if ready else 503)

    async def prometheus(request: Request) -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        nonlocal loop
        loop = asyncio.get_running_loop()
        reloader.start()
        await backend.open(metrics)
        await cache.start()
        await cache.publish_version(catalog.version)
        await tasks.start()
        remove_sighup = _on_sighup(loop, reloader, authenticator.api_keys.reload)
        gc.collect()
        gc.freeze()  # startup objects never need scanning again: shorter GC pauses, better p99
        gc.set_threshold(*GC_THRESHOLDS)
        try:
            yield
        finally:
            remove_sighup()
            await tasks.close(settings.drain_timeout_s)  # running tasks: finish or fail
            await reloader.close()
            await cache.close()
            await budgets.close()
            await openai.aclose()
            await backend.aclose()

    def begin_drain() -> None:
        """Not ready from now on, and listen streams end (they would hold the drain open).
        Safe to call from a signal handler or another thread."""
        app.state.draining = True
        if loop is not None:
            loop.call_soon_threadsafe(reloader.end_listen_streams)

    doors: dict[str, ASGIApp] = {MCP_PATH: endpoint, **dict.fromkeys(openai.routes, openai)}
    app = Starlette(
        routes=[
            # every method, and any other /v1/ path: the door answers 404 and 405 in its words
            *(Route(path, door) for path, door in doors.items()),
            Route("/healthz", healthz),
            Route("/health", healthz),  # vLLM's path, so fleet health checks find either
            Route("/readyz", readyz),
            Route("/metrics", prometheus),
            *probe_routes(facts, model),  # what sglang-router asks a worker it registers
            *admin_routes(authenticator.admin_enabled, reloader),
            *(console_routes() if settings.ui else ()),
            Route("/v1/{rest:path}", openai),
        ],
        lifespan=lifespan,
        middleware=[  # /healthz, /readyz, /metrics, /admin/*, the console: Origin/Host rules too
            Middleware(
                HostOriginGuard,
                policy=OriginPolicy(settings.host, settings.allowed_origins),
                self_guarded=[MCP_PATH, *openai.routes],
            )
        ],
    )
    app.router = DoorsFirst(app.router, doors)  # before the middleware stack is built
    app.add_middleware(TrimAfterLargeBodies)
    if settings.access_log:  # outermost: its line has the status whoever answered
        app.add_middleware(AccessLog)
    app.add_middleware(
        AuthMiddleware,
        authenticator=authenticator,
        metrics=metrics,
        server_name=settings.server_name,
        render=challenge_body,
    )
    app.state.served = served  # served.current is the catalog being served
    app.state.mcp = endpoint
    app.state.openai = openai
    app.state.metrics = metrics
    app.state.discovery_cache = cache
    app.state.catalog_reloader = reloader
    app.state.draining = False
    app.state.begin_drain = begin_drain
    return app


class DoorsFirst(Router):
    """Starlette's router with the doors' own paths found by one dict lookup, not by matching
    the route list in order: the hot path of every MCP and OpenAI call (the routes stay, for
    the lifespan, ``url_path_for`` and everything else)."""

    def __init__(self, router: Router, doors: dict[str, ASGIApp]) -> None:
        super().__init__(router.routes, lifespan=router.lifespan_context)
        self._doors = doors

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        door = self._doors.get(scope["path"]) if scope["type"] == "http" else None
        if door is None:
            await super().app(scope, receive, send)
            return
        scope.setdefault("router", self)
        await door(scope, receive, send)


def _on_sighup(
    loop: asyncio.AbstractEventLoop, reloader: CatalogReloader, also: Callable[[], None]
) -> Callable[[], None]:
    """SIGHUP re-reads the catalog config and runs ``also`` (the API keys file) — main thread
    only: signals go there; returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    pending: set[asyncio.Task[None]] = set()

    async def reload() -> None:
        try:
            result = await reloader.reload("signal")
        except CatalogConfigError as exc:
            log.error(
                "SIGHUP: catalog config not loaded, still serving %s: %s",
                reloader.served.current.version,
                exc,
            )
            return
        log.info("SIGHUP: catalog %s", "now " + result.version if result.changed else "unchanged")

    def schedule() -> None:
        task = loop.create_task(reload())  # the catalog reloads whatever ``also`` does
        pending.add(task)
        task.add_done_callback(pending.discard)
        try:
            also()
        except Exception:  # noqa: BLE001 - a signal handler must not raise; the keys stay
            log.exception("SIGHUP: API keys not reloaded, the previous keys stay in force")

    loop.add_signal_handler(signal.SIGHUP, schedule)
    return lambda: None if loop.remove_signal_handler(signal.SIGHUP) else None
