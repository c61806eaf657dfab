"""One engine (the embedded tiny model, a small KV pool) and one live kvgate for the gateway
tests; both are built once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvgate.engine import AsyncLLM, EngineConfig
from tests.gateway.live_server import LiveServer


@pytest.fixture(scope="session")
def engine() -> Iterator[AsyncLLM]:
    llm = AsyncLLM(EngineConfig(kv_cache_memory="16MiB", seed=0))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="session")
def server(engine: AsyncLLM) -> Iterator[LiveServer]:
    with LiveServer(
        engine,
        max_body_bytes=64 * 1024,
        keepalive_s=0.2,
        allowed_origins=("https://app.example.com",),
    ) as live:
        yield live


@pytest.fixture(scope="session")
def tiny_engine_config() -> dict:
    """What the shared engine is built from, for tests that need their own engine limits."""
    return {"kv_cache_memory": "16MiB", "seed": 0}
