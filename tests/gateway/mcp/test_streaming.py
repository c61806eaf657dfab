"""SSE: progress then result for tools/call, cancellation by disconnect, subscriptions/listen."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from kvgate.engine import AsyncLLM
from kvgate.gateway.catalog.catalog import Catalog
from kvgate.schemas.mcp_wire import validate_server_message
from tests.gateway.live_server import LiveServer
from tests.gateway.wire import MODERN, call, modern_headers, modern_meta


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as client:
        yield client


def stream_request(
    method: str, params: dict[str, Any], name: str | None = None, request_id: int = 1, **meta: Any
) -> tuple[bytes, dict[str, str]]:
    body = {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": method,
        "params": {**params, "_meta": modern_meta(**meta)},
    }
    return orjson.dumps(body), modern_headers(method, name)


def events(response: httpx.Response, method: str = "tools/call") -> Iterator[dict[str, Any] | None]:
    """Each SSE data payload (schema-checked), or None for a comment line (keep-alive)."""
    for line in response.iter_lines():
        if line.startswith(":"):
            yield None
        elif line.startswith("data:"):
            message = orjson.loads(line[5:])
            validate_server_message(MODERN, message, method)
            yield message


def test_progress_then_result(http: httpx.Client, server: LiveServer) -> None:
    arguments = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    exchange = call(
        http,
        server.url,
        "tools/call",
        {"name": "generate", "arguments": arguments},
        name="generate",
        meta={"progressToken": "tok-1"},
    )
    assert exchange.headers["content-type"].startswith("text/event-stream")
    assert exchange.headers["x-accel-buffering"] == "no"
    *progress, final = exchange.messages
    assert progress and all(m["method"] == "notifications/progress" for m in progress)
    assert all(m["params"]["progressToken"] == "tok-1" for m in progress)
    counts = [m["params"]["progress"] for m in progress]
    assert counts == sorted(set(counts))  # strictly increasing token counts
    structured = final["result"]["structuredContent"]
    assert "".join(m["params"]["message"] for m in progress) == structured["text"]
    assert counts[-1] <= structured["completion_tokens"]
    plain = call(
        http,
        server.url,
        "tools/call",
        {"name": "generate", "arguments": arguments},
        name="generate",
    )
    assert plain.result["structuredContent"]["text"] == structured["text"]


def test_progress_token_without_sse_accept_gets_json(
    http: httpx.Client, server: LiveServer
) -> None:
    arguments = {"prompt": "Hi", "max_tokens": 2}
    exchange = call(
        http,
        server.url,
        "tools/call",
        {"name": "generate", "arguments": arguments},
        name="generate",
        meta={"progressToken": 7},
        headers={"Accept": "application/json"},
    )
    assert exchange.headers["content-type"] == "application/json"
    assert len(exchange.messages) == 1 and "result" in exchange.body


def wait_idle(engine: AsyncLLM, seconds: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_usage == 0:
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"engine still busy after {seconds}s: {engine.stats()}")


def test_disconnect_cancels_generation_and_frees_blocks(
    http: httpx.Client, server: LiveServer, engine: AsyncLLM
) -> None:
    arguments = {"prompt": "A long story begins", "max_tokens": 3000, "temperature": 1.0, "seed": 1}
    content, headers = stream_request(
        "tools/call",
        {"name": "generate", "arguments": arguments},
        "generate",
        progressToken="cancel-me",
    )
    with http.stream("POST", server.url, content=content, headers=headers) as response:
        first = next(e for e in events(response) if e is not None)
        assert first["method"] == "notifications/progress"
        assert engine.stats().num_running == 1
    wait_idle(engine, 1.0)
    metrics = http.get(server.base + "/metrics").text
    running = next(
        line for line in metrics.splitlines() if line.startswith("vllm:num_requests_running{")
    )
    assert running.endswith(" 0.0")
    assert (
        'kvgate_requests_total{api="mcp",method="tools/call",outcome="cancelled",tool="generate"}'
        in metrics
    )


def test_json_call_is_cancelled_by_disconnect_too(
    http: httpx.Client, server: LiveServer, engine: AsyncLLM
) -> None:
    # Greedy: the tiny model's greedy answer runs all 3,000 tokens (~3 s on a Zen 5); a seeded
    # sample reached EOS at token 550, which a fast machine finished inside the 0.5 s timeout.
    arguments = {"prompt": "Another long story", "max_tokens": 3000, "temperature": 0.0}
    content, headers = stream_request(
        "tools/call", {"name": "generate", "arguments": arguments}, "generate"
    )
    with pytest.raises(httpx.ReadTimeout):
        http.post(server.url, content=content, headers=headers, timeout=0.5)
    wait_idle(engine, 1.0)


def test_listen_acknowledges_then_announces_changes(http: httpx.Client, server: LiveServer) -> None:
    wanted = {
        "toolsListChanged": True,
        "promptsListChanged": True,
        "resourceSubscriptions": ["x:/"],
    }
    content, headers = stream_request(
        "subscriptions/listen", {"notifications": wanted}, request_id=42
    )
    with http.stream("POST", server.url, content=content, headers=headers) as response:
        assert response.headers["x-accel-buffering"] == "no"
        stream = events(response, "subscriptions/listen")
        ack = next(stream)
        assert ack["method"] == "notifications/subscriptions/acknowledged"
        assert ack["params"]["_meta"] == {"io.modelcontextprotocol/subscriptionId": 42}
        assert ack["params"]["notifications"] == {
            "toolsListChanged": True,
            "promptsListChanged": True,
        }
        assert next(stream) is None  # a keep-alive comment while nothing changes
        reloader, original = server.app.state.catalog_reloader, server.app.state.served.current
        try:
            server.run(reloader.serve(Catalog(original.facts, instructions="Changed.")))
            changes = [e for e in (next(stream), next(stream), next(stream)) if e is not None][:2]
        finally:
            server.run(reloader.serve(original))
    assert sorted(e["method"] for e in changes) == [
        "notifications/prompts/list_changed",
        "notifications/tools/list_changed",
    ]
    assert all(
        e["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == 42 for e in changes
    )


def test_listen_ends_gracefully_when_its_time_is_up(engine: AsyncLLM) -> None:
    with LiveServer(engine, keepalive_s=0.05, listen_max_s=0.3) as short, httpx.Client() as client:
        content, headers = stream_request(
            "subscriptions/listen", {"notifications": {}}, request_id="s"
        )
        with client.stream("POST", short.url, content=content, headers=headers) as response:
            messages = [e for e in events(response, "subscriptions/listen") if e is not None]
    assert messages[0]["params"]["notifications"] == {}
    closing = messages[-1]
    assert closing["id"] == "s" and closing["result"]["resultType"] == "complete"
    assert closing["result"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == "s"
