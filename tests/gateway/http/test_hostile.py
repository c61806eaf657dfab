"""Hostile requests over real sockets against a real uvicorn with kvgate's http protocol:
endless header lines, slow pipelined heads, duplicated routing headers, DNS rebinding on
every route, and the smaller HTTP rules (Host, 414, media types, Accept weights)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from kvgate.engine import AsyncLLM
from tests.gateway.live_server import LiveServer
from tests.gateway.mcp.test_streaming import stream_request
from tests.gateway.wire import call, modern_headers, modern_meta, post


@pytest.fixture(scope="module")
def live(engine: AsyncLLM) -> Iterator[LiveServer]:
    with LiveServer(
        engine,
        max_header_bytes=4096,
        header_timeout_s=0.5,
        listen_max_s=1.5,
        keepalive_s=0.2,
        admin_api_key="secret",
    ) as server:
        yield server


def exchange(live: LiveServer, data: bytes, timeout_s: float = 5) -> bytes:
    """Send ``data`` on a fresh connection; everything the server sends until it closes."""
    with socket.create_connection(("127.0.0.1", live.port), timeout=timeout_s) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        return _read_all(sock)


def _read_all(sock: socket.socket) -> bytes:
    reply = b""
    try:
        while chunk := sock.recv(65536):
            reply += chunk
    except ConnectionResetError:
        pass
    return reply


def mcp_request(
    method: str, *extra: tuple[str, str], name: str | None = None, **arguments: str
) -> bytes:
    """A raw modern MCP POST with its standard headers, then ``extra`` header lines."""
    params: dict[str, object] = {"_meta": modern_meta()}
    if name is not None:
        params.update(name=name, arguments={"prompt": "hi", "max_tokens": 1, **arguments})
    body = orjson.dumps({"jsonrpc": "2.0", "id": 7, "method": method, "params": params})
    lines = [("Host", "127.0.0.1"), *modern_headers(method, name).items(), *extra]
    lines.append(("Content-Length", str(len(body))))
    head = "".join(f"{k}: {v}\r\n" for k, v in lines)
    return b"POST /mcp HTTP/1.1\r\n" + head.encode() + b"Connection: close\r\n\r\n" + body


def status_and_body(reply: bytes) -> tuple[int, bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def rss_mib() -> float:
    """This process's resident memory (the live server runs in it)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def test_an_endless_header_line_is_refused_once_it_passes_the_limit(live: LiveServer) -> None:
    """The line is never completed: the server answers 431 after the limit, not at the
    header timeout, and stops reading (most of the 8 MiB cannot even be sent); memory does
    not grow with it (it grew by twice the line before) and /healthz stays quick."""
    before = rss_mib()
    started = time.monotonic()
    sent = 0
    with socket.create_connection(("127.0.0.1", live.port), timeout=5) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Endless: ")
        try:
            for _ in range(128):
                sock.sendall(b"a" * 65536)
                sent += 65536
        except OSError:  # reset or broken pipe: the server hung up on us
            pass
        reply = _read_all(sock)
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:80]
    assert time.monotonic() - started < 0.5 * 4  # well before trickling would be timed out
    assert sent < 8 << 20
    assert rss_mib() - before < 10
    with httpx.Client(base_url=live.base) as http:
        began = time.monotonic()
        assert http.get("/healthz").status_code == 200
        assert time.monotonic() - began < 1


def test_a_head_trickled_behind_a_long_request_is_cut_off(live: LiveServer) -> None:
    """A listen stream runs 1.5 s; behind it, on the same connection, a request head comes
    one byte every 0.1 s. Its header deadline (0.5 s) passes while the stream runs: it is
    answered 408 when the stream ends, and the connection closes (it used to stay open)."""
    content, headers = stream_request(
        "subscriptions/listen", {"notifications": {"toolsListChanged": True}}
    )
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    listen = (
        b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        + head.encode()
        + f"Content-Length: {len(content)}\r\n\r\n".encode()
        + content
    )
    trickle = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"z" * 200
    started = time.monotonic()
    reply = b""
    with socket.create_connection(("127.0.0.1", live.port), timeout=5) as sock:
        sock.sendall(listen)
        sock.settimeout(0.1)
        for byte in trickle:
            try:
                sock.sendall(bytes([byte]))
            except OSError:
                break
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:  # closed with our unread trickle pending: a reset
                break
            if not chunk:
                break
            reply += chunk
        closed_after = time.monotonic() - started
    assert b"notifications/subscriptions/acknowledged" in reply  # the stream was served
    assert b"HTTP/1.1 408 " in reply or reply.endswith(b"\r\n0\r\n\r\n")  # 408, or reset
    assert 1.4 < closed_after < 4  # after the stream (1.5 s), long before the trickle (20 s)


@pytest.mark.parametrize(
    "duplicate",
    [
        ("Mcp-Method", "tools/list"),
        ("Mcp-Method", "prompts/list"),
        ("MCP-Protocol-Version", "2025-06-18"),
        ("Mcp-Name", "generate"),
        ("Mcp-Param-Cache-Key", "k"),
    ],
)
def test_a_repeated_routing_header_is_a_header_mismatch(
    live: LiveServer, duplicate: tuple[str, str]
) -> None:
    if duplicate[0] == "Mcp-Name":  # sent once by mcp_request, then again
        request = mcp_request("tools/call", duplicate, name="generate")
    elif duplicate[0] == "Mcp-Param-Cache-Key":  # both lines agree with the body, even
        request = mcp_request("tools/call", duplicate, duplicate, name="generate", cache_key="k")
    else:
        request = mcp_request("tools/list", duplicate)
    status, body = status_and_body(exchange(live, request))
    assert status == 400
    error = orjson.loads(body)["error"]
    assert error["code"] == -32020 and "more than one" in error["message"]


def test_a_repeated_origin_or_host_is_refused_on_every_route(live: LiveServer) -> None:
    origin = ("Origin", "http://localhost")
    status, body = status_and_body(exchange(live, mcp_request("tools/list", origin, origin)))
    assert status == 400 and orjson.loads(body)["error"]["code"] == -32600
    evil_pair = b"Origin: https://evil.example\r\nOrigin: http://localhost\r\n"
    reply = exchange(live, b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n" + evil_pair + b"\r\n")
    assert reply.startswith(b"HTTP/1.1 400 ")
    two_hosts = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n\r\n"
    assert exchange(live, two_hosts).startswith(b"HTTP/1.1 400 ")


def test_a_param_header_for_an_argument_the_body_lacks_is_a_mismatch(live: LiveServer) -> None:
    with httpx.Client() as http:
        mismatch = call(
            http,
            live.url,
            "tools/call",
            {"name": "generate", "arguments": {"prompt": "hi", "max_tokens": 1}},
            name="generate",
            headers={"Mcp-Param-Cache-Key": "tenant-a"},
        )
    assert mismatch.status == 400 and mismatch.error["code"] == -32020
    assert "Mcp-Param-Cache-Key" in mismatch.error["message"]


@pytest.mark.parametrize("path", ["/healthz", "/readyz", "/metrics", "/admin/catalog/reload"])
def test_dns_rebinding_is_refused_on_every_route(live: LiveServer, path: str) -> None:
    method = "POST" if path.startswith("/admin") else "GET"
    auth = {"Authorization": "bearer secret"}  # the scheme is case-insensitive
    with httpx.Client() as http:
        rebound = http.request(method, live.base + path, headers={"Host": "evil.example", **auth})
        foreign = http.request(
            method, live.base + path, headers={"Origin": "https://evil.example", **auth}
        )
        local = http.request(
            method, live.base + path, headers={"Origin": "http://localhost", **auth}
        )
    assert (rebound.status_code, foreign.status_code) == (403, 403)
    assert local.status_code == 200, local.text


def test_a_batch_is_refused_under_every_version_header(live: LiveServer) -> None:
    """2025-03-26 allowed batches; kvgate, like the official SDK, refuses them everywhere
    (also with no MCP-Protocol-Version header, which means 2025-03-26)."""
    batch = [{"jsonrpc": "2.0", "id": 1, "method": "ping"}]
    base = {"Content-Type": "application/json", "Accept": "application/json"}
    with httpx.Client() as http:
        for version in (None, "2025-03-26", "2025-06-18"):
            headers = base if version is None else {**base, "MCP-Protocol-Version": version}
            refused = post(http, live.url, orjson.dumps(batch), headers, wire=None)
            assert refused.status == 400 and refused.error["code"] == -32600


def test_host_is_required_in_http_1_1(live: LiveServer) -> None:
    """No Host in HTTP/1.1 is malformed (400); HTTP/1.0 may omit it, and then meets the
    loopback server's Host rule (403)."""
    assert exchange(live, b"GET /healthz HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    assert exchange(live, b"GET /healthz HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.1 403 ")


def test_an_overlong_request_target_is_414(live: LiveServer) -> None:
    target = b"/healthz?" + b"q" * 3000  # over half the 4 KiB head limit
    reply = exchange(live, b"GET " + target + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 414 ")
    fine = exchange(live, b"GET /healthz?q=1 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert fine.startswith(b"HTTP/1.1 200 ")


@pytest.mark.parametrize(
    ("content_type", "status"),
    [
        ("application/jsonp", 415),
        ("application/json-seq", 415),
        ("application/json5", 415),
        ("text/json", 415),
        ("Application/JSON; charset=utf-8", 200),
        ("application/json ;charset=utf-8", 200),
    ],
)
def test_content_type_is_matched_exactly(live: LiveServer, content_type: str, status: int) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "params": {"_meta": modern_meta()}}
    headers = modern_headers("tools/list", **{"Content-Type": content_type})
    with httpx.Client() as http:
        assert post(http, live.url, body, headers, wire=None).status == status


def test_event_stream_weighted_zero_gets_json(live: LiveServer) -> None:
    arguments = {"prompt": "Once", "max_tokens": 2, "temperature": 0}
    with httpx.Client(timeout=30) as http:
        answers = {
            accept: call(
                http,
                live.url,
                "tools/call",
                {"name": "generate", "arguments": arguments},
                name="generate",
                meta={"progressToken": "p"},
                headers={"Accept": accept},
            )
            for accept in ("application/json, text/event-stream;q=0", "text/event-stream")
        }
    json_answer, sse_answer = answers.values()
    assert json_answer.headers["content-type"].startswith("application/json")
    assert sse_answer.headers["content-type"].startswith("text/event-stream")
    refused = {"Accept": "text/event-stream;q=0, application/json;q=0"}
    with httpx.Client() as http:
        not_acceptable = call(http, live.url, "tools/list", headers=refused)
    assert not_acceptable.status == 406


def test_an_integral_float_is_an_integer(live: LiveServer) -> None:
    """JSON Schema 2020-12: 8.0 is an integer; the call runs as max_tokens 8."""
    arguments = {"prompt": "Once upon a time", "max_tokens": 8.0, "temperature": 0}
    with httpx.Client(timeout=30) as http:
        done = call(
            http,
            live.url,
            "tools/call",
            {"name": "generate", "arguments": arguments},
            name="generate",
        )
    assert done.status == 200 and done.result["isError"] is False, done.body
    assert 0 < done.result["structuredContent"]["completion_tokens"] <= 8


def test_a_huge_body_is_parsed_and_validated_off_the_event_loop(live: LiveServer) -> None:
    """~1 MiB of chat messages took the JSON depth walk and the schema validator over a
    second on the event loop; now /healthz answers within 0.5 s throughout."""
    messages = [{"role": "user", "content": "hi"}] * 30_000
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "chat", "arguments": {"messages": messages, "max_tokens": 1}},
    }
    content = orjson.dumps(body)
    assert 800_000 < len(content) < 1 << 20
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    result: list[int] = []

    def big() -> None:
        with httpx.Client(timeout=60) as http:
            result.append(http.post(live.url, content=content, headers=headers).status_code)

    worker = threading.Thread(target=big)
    slowest = 0.0
    with httpx.Client(base_url=live.base, timeout=10) as http:
        http.get("/healthz")
        worker.start()
        while worker.is_alive() and len(result) == 0:
            began = time.monotonic()
            assert http.get("/healthz").status_code == 200
            slowest = max(slowest, time.monotonic() - began)
            time.sleep(0.02)
        worker.join(timeout=60)
    assert result == [200]
    assert slowest < 0.5
