"""Abuse limits below and at the MCP endpoint, over raw sockets: oversized or slow headers,
a slow body, deep JSON, and a client that stops reading its SSE stream."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest

from kvgate.engine import AsyncLLM
from tests.gateway.live_server import LiveServer
from tests.gateway.mcp.test_streaming import stream_request, wait_idle
from tests.gateway.wire import call, modern_headers, modern_meta, post


@pytest.fixture(scope="module")
def live(engine: AsyncLLM) -> Iterator[LiveServer]:
    with LiveServer(
        engine, max_header_bytes=4096, header_timeout_s=0.5, body_timeout_s=0.5, max_json_depth=16
    ) as server:
        yield server


def raw(live: LiveServer, data: bytes, pause_s: float = 0.0, rest: bytes = b"") -> bytes:
    """Send ``data`` (then ``rest`` after ``pause_s``) on a fresh connection; the reply."""
    with socket.create_connection(("127.0.0.1", live.port), timeout=5) as sock:
        sock.sendall(data)
        if pause_s:
            time.sleep(pause_s)
            try:
                sock.sendall(rest)
            except OSError:
                pass
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
        return reply


def test_oversized_headers_are_431(live: LiveServer) -> None:
    reply = raw(
        live, b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n"
    )
    assert reply.startswith(b"HTTP/1.1 431 ")


def test_headers_that_trickle_in_are_cut_off_with_408(live: LiveServer) -> None:
    started = time.monotonic()
    reply = raw(
        live, b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n", pause_s=2.0, rest=b"X: y\r\n\r\n"
    )
    assert reply.startswith(b"HTTP/1.1 408 ")
    assert time.monotonic() - started < 4


def test_a_silent_connection_is_closed(live: LiveServer) -> None:
    assert raw(live, b"", pause_s=1.0).startswith(b"HTTP/1.1 408 ")


def test_a_body_that_never_completes_is_408(live: LiveServer) -> None:
    head = (
        b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"jsonrpc":'
    )
    reply = raw(live, head, pause_s=1.5)
    assert reply.startswith(b"HTTP/1.1 408 ") and b"connection: close" in reply.lower()
    assert orjson.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == -32600
    metrics = httpx.get(live.base + "/metrics").text
    assert 'kvgate_rejected_requests_total{reason="body_timeout"} 1.0' in metrics


def test_json_deeper_than_the_limit_is_an_invalid_request(live: LiveServer) -> None:
    with httpx.Client() as http:
        nested: object = "x"
        for _ in range(20):
            nested = {"n": nested}
        body = {
            "jsonrpc": "2.0",
            "id": 9,
            "method": "tools/list",
            "params": {"deep": nested, "_meta": modern_meta()},
        }
        exchange = post(http, live.url, body, modern_headers("tools/list"))
        assert exchange.status == 400 and exchange.error["code"] == -32600
        assert exchange.body["id"] == 9 and "deeper than 16" in exchange.error["message"]
        pathological = b"[" * 100_000 + b"]" * 100_000  # past orjson's own recursion limit
        exchange = post(http, live.url, pathological, modern_headers("tools/list"))
        assert exchange.status == 400 and exchange.error["code"] == -32600


def test_a_client_that_stops_reading_its_stream_stalls_nobody(
    live: LiveServer, engine: AsyncLLM
) -> None:
    """It asks for a long streamed generation and never reads a byte (a tiny receive
    window); meanwhile other calls finish as usual, and its deadline ends it."""
    arguments = {"prompt": "A story that goes on and on", "max_tokens": 3000, "temperature": 0}
    content, headers = stream_request(
        "tools/call",
        {"name": "generate", "arguments": arguments},
        "generate",
        progressToken="slow",
        **{"dev.kvgate/timeoutMs": 2000},
    )
    request = (
        b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + b"".join(f"{k}: {v}\r\n".encode() for k, v in headers.items())
        + f"Content-Length: {len(content)}\r\n\r\n".encode()
        + content
    )
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(("127.0.0.1", live.port))
    try:
        slow.sendall(request)
        deadline = time.monotonic() + 5
        while engine.stats().num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)

        def quick_call(i: int) -> float:
            started = time.monotonic()
            with httpx.Client(timeout=10) as http:
                exchange = call(
                    http,
                    live.url,
                    "tools/call",
                    {
                        "name": "generate",
                        "arguments": {"prompt": f"quick {i}", "max_tokens": 4, "temperature": 0},
                    },
                    name="generate",
                )
            assert exchange.status == 200 and not exchange.result["isError"]
            return time.monotonic() - started

        with ThreadPoolExecutor(4) as pool:
            took = list(pool.map(quick_call, range(8)))
        assert max(took) < 1.5  # served while the slow stream was still being generated
        wait_idle(engine, 10.0)  # the deadline (2 s) has ended the slow one and freed its blocks
        engine.core.pool.check_invariants()
    finally:
        slow.close()
