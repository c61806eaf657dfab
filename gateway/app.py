"""The Starlette application: the MCP endpoint plus health, readiness and metrics.

The engine is built by the caller (CLI or test) and handed in, so one engine can back several
apps in tests and its lifetime stays with whoever created it.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.catalog import Catalog, ModelFacts
from gateway.discovery_cache import make_discovery_cache
from gateway.mcp_endpoint import McpEndpoint
from gateway.metrics import Metrics
from gateway.settings import Settings
from gateway.tools import InferenceTools

MCP_PATH = "/mcp"


def model_facts(engine: Any, settings: Settings) -> ModelFacts:
    stats = engine.stats()
    return ModelFacts(
        name=engine.model_name,
        max_model_len=engine.max_model_len,
        block_size=stats.block_size,
        num_blocks=stats.num_blocks,
        kv_cache_dtype=stats.cache_dtype,
        replicas=len(stats.per_replica) or settings.replicas,
    )


def create_app(settings: Settings, engine: Any) -> Starlette:
    metrics = Metrics(engine.stats, engine.model_name)
    catalog = Catalog(
        model_facts(engine, settings), settings.server_name, settings.instructions,
        settings.catalog_ttl_ms,
    )

    def on_cache_event(event: str) -> None:
        if event != "near_hit":  # the hot path's own event stays off it (cache.stats has it)
            metrics.count("kvgate_discovery_cache_events", event=event)

    cache = make_discovery_cache(settings.redis_url, on_event=on_cache_event)
    endpoint = McpEndpoint(settings, catalog, InferenceTools(engine, catalog.tools), cache, metrics)

    async def healthz(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        ready = engine.is_ready()
        return JSONResponse({"ready": ready}, status_code=200 if ready else 503)

    async def prometheus(request: Request) -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await cache.start()
        await cache.publish_version(catalog.version)
        gc.collect()
        gc.freeze()  # startup objects never need scanning again: shorter GC pauses, better p99
        try:
            yield
        finally:
            await cache.close()

    app = Starlette(
        routes=[
            Route(MCP_PATH, endpoint),
            Route("/healthz", healthz),
            Route("/readyz", readyz),
            Route("/metrics", prometheus),
        ],
        lifespan=lifespan,
    )
    app.state.endpoint = endpoint  # endpoint.catalog is the catalog being served
    app.state.metrics = metrics
    app.state.discovery_cache = cache
    return app
