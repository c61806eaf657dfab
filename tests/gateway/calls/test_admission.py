"""Admission control over real HTTP: each limit answers with its status, JSON-RPC code and
Retry-After, is counted in metrics, and leaves no KV block behind."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import orjson
import pytest

from kvgate.engine import AsyncLLM, EngineConfig
from kvgate.protocol.errors import RATE_LIMITED, REQUEST_TIMEOUT, SERVER_OVERLOADED
from tests.gateway.live_server import LiveServer
from tests.gateway.mcp.test_streaming import events, stream_request, wait_idle
from tests.gateway.wire import call

LONG = {
    "prompt": "A story that goes on and on",
    "max_tokens": 3000,
    "temperature": 0,
}  # ~5 s, no EOS


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as client:
        yield client


@contextmanager
def streaming_call(
    http: httpx.Client, url: str, arguments: dict[str, Any], headers: dict[str, str] | None = None
) -> Iterator[httpx.Response]:
    """A generate call held open (its first progress event read) until the block exits."""
    content, base = stream_request(
        "tools/call", {"name": "generate", "arguments": arguments}, "generate", progressToken="held"
    )
    with http.stream("POST", url, content=content, headers={**base, **(headers or {})}) as response:
        stream = events(response)  # kept: closing this iterator would close the response
        assert next(e for e in stream if e is not None)["method"] == "notifications/progress"
        yield response


def rejected(http: httpx.Client, base: str, reason: str) -> float:
    for line in http.get(base + "/metrics").text.splitlines():
        if line.startswith(f'kvgate_rejected_requests_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_per_client_concurrency_is_429_with_retry_after(
    http: httpx.Client, engine: AsyncLLM
) -> None:
    with LiveServer(engine, max_concurrency_per_client=1) as live:
        alice = {"Authorization": "Bearer alice-key"}
        with streaming_call(http, live.url, LONG, alice):
            second = call(
                http,
                live.url,
                "tools/call",
                {"name": "generate", "arguments": {"prompt": "hi", "max_tokens": 2}},
                name="generate",
                headers=alice,
            )
            assert second.status == 429 and second.headers["retry-after"] == "1"
            assert second.error["code"] == RATE_LIMITED and second.body["id"] == 1
            assert second.error["data"] == {"reason": "client_concurrency", "retryAfterS": 1}
            bob = call(
                http,
                live.url,
                "tools/call",
                {"name": "generate", "arguments": {"prompt": "hi", "max_tokens": 2}},
                name="generate",
                headers={"Authorization": "Bearer bob-key"},
            )
            assert bob.status == 200 and not bob.result["isError"]
        assert rejected(http, live.base, "client_concurrency") == 1
        wait_idle(engine, 2.0)
        again = call(
            http,
            live.url,
            "tools/call",
            {"name": "generate", "arguments": {"prompt": "hi", "max_tokens": 2}},
            name="generate",
            headers=alice,
        )
        assert again.status == 200


def test_cache_key_is_the_client_when_there_is_no_api_key(
    http: httpx.Client, engine: AsyncLLM
) -> None:
    with LiveServer(engine, max_concurrency_per_client=1) as live:
        keyed = {**LONG, "cache_key": "tenant-a"}
        with streaming_call(http, live.url, keyed, {"Mcp-Param-Cache-Key": "tenant-a"}):
            same = call(
                http,
                live.url,
                "tools/call",
                {"name": "generate", "arguments": {"prompt": "x", "cache_key": "tenant-a"}},
                name="generate",
                headers={"Mcp-Param-Cache-Key": "tenant-a"},
            )
            assert same.status == 429
    wait_idle(engine, 2.0)


def test_a_full_engine_queue_is_503_with_retry_after_and_queues_nothing(
    http: httpx.Client, tiny_engine_config: dict[str, Any]
) -> None:
    engine = AsyncLLM(EngineConfig(**tiny_engine_config, max_num_seqs=1, max_waiting=1))
    try:
        with LiveServer(engine) as live, ExitStack() as held:
            held.enter_context(streaming_call(http, live.url, LONG))  # running
            content, headers = stream_request(
                "tools/call", {"name": "generate", "arguments": LONG}, "generate"
            )
            waiting = held.enter_context(socket.create_connection(("127.0.0.1", live.port)))
            waiting.sendall(raw_request(content, headers))  # waits; closing the socket cancels it
            wait_for(lambda: engine.stats().num_waiting == 1)
            for meta in ({}, {"progressToken": "sse"}):
                refused = call(
                    http,
                    live.url,
                    "tools/call",
                    {"name": "generate", "arguments": LONG},
                    name="generate",
                    meta=meta,
                )
                assert refused.status == 503 and refused.headers["retry-after"] == "1"
                assert refused.error["code"] == SERVER_OVERLOADED
                assert refused.error["data"]["reason"] == "overloaded"
            assert engine.stats().num_waiting == 1
            assert rejected(http, live.base, "overloaded") == 2
            assert (
                call(
                    http,
                    live.url,
                    "tools/call",
                    {"name": "tokenize", "arguments": {"text": "still served"}},
                    name="tokenize",
                ).status
                == 200
            )
        wait_idle(engine, 2.0)
        engine.core.pool.check_invariants()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("meta", [{}, {"progressToken": "deadline"}])
def test_a_call_past_its_deadline_is_cancelled_with_a_clear_error(
    http: httpx.Client, server: LiveServer, engine: AsyncLLM, meta: dict[str, Any]
) -> None:
    exchange = call(
        http,
        server.url,
        "tools/call",
        {"name": "generate", "arguments": LONG},
        name="generate",
        meta={"dev.kvgate/timeoutMs": 300, **meta},
    )
    assert (
        exchange.error["code"] == REQUEST_TIMEOUT and "timed out after" in exchange.error["message"]
    )
    # A stream that has begun (the first token came in time) carries the error in its last event.
    sse = exchange.headers["content-type"].startswith("text/event-stream")
    assert exchange.status == (200 if sse else 504) and (sse or not meta or exchange.status == 504)
    wait_idle(engine, 2.0)
    engine.core.pool.check_invariants()


@pytest.mark.parametrize("value", [0, -5, "100", True, [1]])
def test_a_bad_timeout_is_invalid_params(
    http: httpx.Client, server: LiveServer, value: Any
) -> None:
    exchange = call(
        http,
        server.url,
        "tools/call",
        {"name": "generate", "arguments": {"prompt": "hi", "max_tokens": 1}},
        name="generate",
        meta={"dev.kvgate/timeoutMs": value},
    )
    assert exchange.status == 400 and exchange.error["code"] == -32602


def test_the_server_timeout_bounds_every_call(http: httpx.Client, engine: AsyncLLM) -> None:
    with LiveServer(engine, request_timeout_s=0.3) as live:
        exchange = call(
            http,
            live.url,
            "tools/call",
            {"name": "generate", "arguments": LONG},
            name="generate",
            meta={"dev.kvgate/timeoutMs": 60_000},
        )  # cannot lengthen
        assert exchange.status == 504 and exchange.error["code"] == REQUEST_TIMEOUT
        assert rejected(http, live.base, "deadline") == 1
    wait_idle(engine, 2.0)


def test_listen_streams_are_capped(http: httpx.Client, engine: AsyncLLM) -> None:
    with LiveServer(engine, max_listen_streams=1, keepalive_s=0.2) as live:
        content, headers = stream_request(
            "subscriptions/listen", {"notifications": {"toolsListChanged": True}}
        )
        with http.stream("POST", live.url, content=content, headers=headers) as first:
            stream = events(first, "subscriptions/listen")
            assert next(stream)["method"].endswith("acknowledged")
            second = http.post(live.url, content=content, headers=headers)
            assert second.status_code == 503 and second.headers["retry-after"] == "5"
            assert orjson.loads(second.content)["error"]["data"]["reason"] == "listen_streams"
        wait_for(lambda: len(live.app.state.mcp.listens) == 0)
        with http.stream("POST", live.url, content=content, headers=headers) as again:
            assert again.status_code == 200


def test_tool_error_when_the_engine_step_fails(
    http: httpx.Client, server: LiveServer, engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = engine.core.replicas[0].runner

    def broken(batch: object) -> None:
        raise RuntimeError("injected device fault")

    monkeypatch.setattr(runner, "execute", broken)
    failed = call(
        http,
        server.url,
        "tools/call",
        {"name": "generate", "arguments": {"prompt": "hi", "max_tokens": 4}},
        name="generate",
    )
    assert failed.status == 200 and failed.result["isError"]
    assert "injected device fault" in failed.result["content"][0]["text"]
    monkeypatch.undo()
    wait_idle(engine, 2.0)
    ok = call(
        http,
        server.url,
        "tools/call",
        {"name": "generate", "arguments": {"prompt": "hi", "max_tokens": 4}},
        name="generate",
    )
    assert ok.status == 200 and not ok.result["isError"]


def raw_request(content: bytes, headers: dict[str, str]) -> bytes:
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return (
        f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n{lines}Content-Length: {len(content)}\r\n\r\n"
    ).encode() + content


def wait_for(condition: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


def test_callers_without_a_key_are_not_limited_together(
    http: httpx.Client, engine: AsyncLLM
) -> None:
    with LiveServer(engine, max_concurrency_per_client=1) as live:
        with streaming_call(http, live.url, LONG):
            anonymous = call(
                http,
                live.url,
                "tools/call",
                {"name": "generate", "arguments": {"prompt": "hi", "max_tokens": 2}},
                name="generate",
            )
            assert anonymous.status == 200
    wait_idle(engine, 2.0)


def test_a_stuck_replica_is_unready_and_calls_are_refused_not_queued(
    http: httpx.Client, server: LiveServer, engine: AsyncLLM
) -> None:
    replica = engine.core.replicas[0]
    replica._step_started = time.monotonic() - 2 * replica.step_timeout_s  # as if stuck in a step
    try:
        ready = http.get(server.base + "/readyz")
        assert (ready.status_code, ready.json()) == (503, {"ready": False, "replicas": [False]})
        refused = call(
            http,
            server.url,
            "tools/call",
            {"name": "generate", "arguments": {"prompt": "hi", "max_tokens": 2}},
            name="generate",
        )
        assert refused.status == 503 and refused.headers["retry-after"] == "1"
        assert refused.error["data"]["reason"] == "unavailable"
    finally:
        replica._step_started = None
    assert http.get(server.base + "/readyz").status_code == 200
