"""Tenants: the authenticated tenant salts the prefix cache (no block is shared across
tenants; a tenant's own calls still share) and keys the per-client concurrency limit (a new
``cache_key`` no longer escapes it)."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator

import httpx
import pytest

from kvgate.engine import AsyncLLM
from tests.gateway.calls.test_admission import LONG, streaming_call
from tests.gateway.live_server import LiveServer
from tests.gateway.mcp.test_streaming import wait_idle
from tests.gateway.wire import call


def keys_line(tenant: str, key: str) -> str:
    return f"{tenant}: {hashlib.sha256(key.encode()).hexdigest()}\n"


ACME = {"Authorization": "Bearer acme-key"}
GLOBEX = {"Authorization": "Bearer globex-key"}


@pytest.fixture(scope="module")
def live(engine: AsyncLLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(keys_line("acme", "acme-key") + keys_line("globex", "globex-key"))
    with LiveServer(engine, api_keys_file=str(path), max_concurrency_per_client=1) as server:
        yield server


def cached(live: LiveServer, headers: dict[str, str], prompt: str, **extra: object) -> int:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
    response = httpx.post(live.base + "/v1/completions", json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_tenants_never_share_cached_blocks(live: LiveServer) -> None:
    prompt = f"{uuid.uuid4()} " + "The quick brown fox jumps over the lazy dog. " * 12
    assert cached(live, ACME, prompt) == 0
    assert cached(live, ACME, prompt) > 0  # acme's own repeat hits
    assert cached(live, ACME, prompt, cache_key="another-session") > 0  # and across sessions
    # globex's identical prompt, even naming acme's session, reaches none of acme's blocks
    assert cached(live, GLOBEX, prompt, cache_key="another-session") == 0
    assert cached(live, GLOBEX, prompt) > 0  # its own, cached by that call
    assert cached(live, GLOBEX, prompt, cache_salt="acme") == 0  # a salt reaches no one else


def test_a_new_cache_key_does_not_escape_the_tenant_limit(live: LiveServer) -> None:
    with httpx.Client(timeout=60) as http:
        held = {**LONG, "cache_key": "session-1"}
        with streaming_call(http, live.url, held, {**ACME, "Mcp-Param-Cache-Key": "session-1"}):
            args = {"prompt": "hi", "max_tokens": 2, "cache_key": "session-2"}
            dodge = call(
                http,
                live.url,
                "tools/call",
                {"name": "generate", "arguments": args},
                name="generate",
                headers={**ACME, "Mcp-Param-Cache-Key": "session-2"},
            )
            assert dodge.status == 429 and dodge.error["data"]["reason"] == "client_concurrency"
            openai = http.post(
                live.base + "/v1/completions",
                json={"prompt": "hi", "max_tokens": 1, "cache_key": "session-3"},
                headers=ACME,
            )
            assert openai.status_code == 429 and openai.headers["retry-after"] == "1"
            other = http.post(
                live.base + "/v1/completions",
                json={"prompt": "hi", "max_tokens": 1},
                headers=GLOBEX,
            )
            assert other.status_code == 200
    wait_idle(live.app.state.openai.generations.backend.engine, 5.0)
