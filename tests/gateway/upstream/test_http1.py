"""The upstream HTTP/1.1 client against raw asyncio servers that answer byte for byte."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from kvgate.gateway.upstream import http1

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


@asynccontextmanager
async def serving(
    handler: Handler, body_type: str | None = None
) -> AsyncIterator[tuple[http1.Pool, list[int]]]:
    """A server running ``handler`` per connection; the pool, and one entry per connection."""
    connections: list[int] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = http1.Pool(f"http://127.0.0.1:{port}", {"accept-encoding": "identity"}, 2.0, body_type)
    try:
        yield pool, connections
    finally:
        await pool.aclose()
        server.close()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.startswith(b"content-len")
    )
    return head + await reader.readexactly(length)


async def answer_each(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, reply: bytes = OK
) -> None:
    while True:
        try:
            await read_request(reader)
        except asyncio.IncompleteReadError:
            return
        writer.write(reply)
        await writer.drain()


def test_keep_alive_reuses_one_connection() -> None:
    async def run() -> None:
        async with serving(answer_each) as (pool, connections):
            for _ in range(5):
                response = await pool.request("POST", "/v1/x", b'{"a":1}')
                assert (response.status, await response.read()) == (200, b"{}")
                assert response.headers["content-type"] == "application/json"
            assert len(connections) == 1

    asyncio.run(run())


def test_the_request_carries_its_headers_and_body() -> None:
    seen: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(OK)
        await writer.drain()

    async def run() -> None:
        async with serving(record) as (pool, _):
            response = await pool.request("POST", "/v1/y", b"body", {"x-call": "7"})
            await response.read()
        head, body = seen[0].split(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        assert lines[0] == b"POST /v1/y HTTP/1.1"
        assert {b"accept-encoding: identity", b"x-call: 7", b"content-length: 4"} <= set(lines)
        assert any(line.startswith(b"host: 127.0.0.1:") for line in lines)
        assert body == b"body"

    asyncio.run(run())


def test_the_body_type_goes_only_on_requests_with_a_body() -> None:
    seen: list[bytes] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(3):
            seen.append(await read_request(reader))
            writer.write(OK)
            await writer.drain()

    async def run() -> None:
        async with serving(record, "application/json") as (pool, _):
            for method, body in (("POST", b"{}"), ("GET", b""), ("POST", b"[]")):
                await (await pool.request(method, "/v1/x", body)).read()

    asyncio.run(run())
    typed = [b"content-type: application/json" in request for request in seen]
    assert typed == [True, False, True]


def test_chunked_and_close_delimited_bodies() -> None:
    chunked = (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )
    until_close = b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nall of it"

    async def once(reply: bytes) -> Handler:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(reply)
            await writer.drain()

        return handler

    async def run() -> None:
        async with serving(await once(chunked)) as (pool, _):
            response = await pool.request("GET", "/")
            assert await response.read() == b"hello world"
        async with serving(await once(until_close)) as (pool, connections):
            response = await pool.request("GET", "/")
            assert await response.read() == b"all of it"
            response = await pool.request("GET", "/")  # not pooled: a new connection
            assert await response.read() == b"all of it"
            assert len(connections) == 2

    asyncio.run(run())


def test_a_body_closed_early_closes_its_connection() -> None:
    async def run() -> None:
        reply = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial"
        async with serving(lambda r, w: answer_each(r, w, reply)) as (pool, connections):
            response = await pool.request("GET", "/")
            async for piece in response.chunks():
                assert piece == b"partial"
                break  # the caller stops reading: the connection cannot be reused
            response = await pool.request("GET", "/")
            response.close()
            assert len(connections) == 2

    asyncio.run(run())


def test_an_upstream_closing_mid_body_is_an_error() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()

    async def run() -> None:
        async with serving(cut) as (pool, _):
            response = await pool.request("GET", "/")
            with pytest.raises(http1.FramingError, match="closed the connection"):
                await response.read()

    asyncio.run(run())


def test_malformed_answers_and_silence() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SPDY/9 nonsense\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    async def run() -> None:
        async with serving(garbage) as (pool, _):
            with pytest.raises(http1.FramingError, match="malformed HTTP"):
                await pool.request("GET", "/")
        async with serving(silent) as (pool, _):
            with pytest.raises(TimeoutError):
                await pool.request("GET", "/", read_timeout_s=0.2)

    asyncio.run(run())


CHUNKED = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
BLOCK = b"a" * (64 << 10)
FLOOD_BYTES = 256 << 20


@pytest.mark.parametrize(
    ("head", "block"),
    [
        (b"HTTP/1.1 200 OK\r\nx-endless: ", BLOCK),  # a header line that never ends
        (b"HTTP/1.1 200 OK\r\n", b"x-h: a\r\n" * 4096),  # header lines that never end
        (CHUNKED + b"1;", BLOCK),  # a chunk extension that never ends
        (CHUNKED + b"2\r\n{}\r\n0\r\nx-trailer: ", BLOCK),  # a trailer that never ends
    ],
    ids=["header-line", "header-lines", "chunk-extension", "trailer"],
)
def test_framing_that_never_ends_is_cut_as_it_arrives(head: bytes, block: bytes) -> None:
    """At most ``MAX_FRAMING_BYTES`` are fed to the parser without a body byte: the call
    fails at once and the connection is closed, so the upstream gets little out (what the
    loopback socket buffers hold)."""
    sent: list[int] = []

    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(head)
        total = 0
        try:
            while total < FLOOD_BYTES:
                writer.write(block)
                await writer.drain()
                total += len(block)
        except ConnectionError:
            pass
        sent.append(total)

    async def run() -> None:
        async with serving(flood) as (pool, _):
            with pytest.raises(http1.FramingError, match=r"over (65536 bytes|128 header)"):
                response = await pool.request("GET", "/", read_timeout_s=2)
                await response.read()
            for _ in range(200):  # the server sees the hang-up
                if sent:
                    break
                await asyncio.sleep(0.01)

    asyncio.run(run())
    assert sent and sent[0] < 16 << 20, sent


def test_a_failed_connection_keeps_no_frames_and_no_body() -> None:
    """The error a connection keeps was never raised: raised, it would hold the frames it
    passed through, one of them holding the connection (a cycle that kept a call's buffers
    until the cyclic GC ran). Discarded, a connection lets its unread body go at once."""
    garbage = b"SPDY/9 nonsense\r\n\r\n"
    partial = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nunread"

    async def run() -> None:
        async with serving(lambda r, w: answer_each(r, w, garbage)) as (pool, _):
            connection = await pool._connect()
            with pytest.raises(http1.FramingError):
                await pool._exchange(connection, b"GET / HTTP/1.1\r\n\r\n", 2)
            assert connection.error is not None and connection.error.__traceback__ is None
        async with serving(lambda r, w: answer_each(r, w, partial)) as (pool, _):
            response = await pool.request("GET", "/")
            connection = response._connection
            await asyncio.sleep(0.1)  # the body's start has come
            assert connection.body
            response.close()  # unread: the connection is discarded
            assert not connection.body

    asyncio.run(run())


def test_header_lines_are_counted() -> None:
    many = b"HTTP/1.1 200 OK\r\n" + b"x-h: a\r\n" * (http1.MAX_HEADERS + 1) + b"\r\n"

    async def run() -> None:
        async with serving(lambda r, w: answer_each(r, w, many)) as (pool, _):
            with pytest.raises(http1.FramingError, match="header lines"):
                await pool.request("GET", "/")

    asyncio.run(run())


EXTRA = b"HTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\nSMUGGLED"


@pytest.mark.parametrize(
    "after",
    [EXTRA, b"SMUGGLED", b"\r\n" + EXTRA],
    ids=["a-second-response", "past-the-content-length", "after-a-blank-line"],
)
@pytest.mark.parametrize("framing", ["sized", "chunked"])
def test_bytes_after_a_complete_answer_close_the_connection(after: bytes, framing: str) -> None:
    """Nothing after the answer reaches the caller, in the same write or not, and the
    connection is never reused: the next call opens a new one and gets its own answer."""
    answer = OK if framing == "sized" else CHUNKED + b"2\r\n{}\r\n0\r\n\r\n"
    heads = {"sized": {"content-type", "content-length"}, "chunked": {"transfer-encoding"}}

    async def run() -> None:
        async with serving(lambda r, w: answer_each(r, w, answer + after)) as (pool, opened):
            for _ in range(3):
                response = await pool.request("GET", "/")
                assert await response.read() == b"{}"
                assert set(response.headers) == heads[framing]  # none of the second's
            assert len(opened) == 3

    asyncio.run(run())


def test_bytes_on_an_idle_connection_close_it() -> None:
    async def late(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(OK)
            await asyncio.sleep(0.05)  # the connection is back in the pool
            writer.write(EXTRA)  # an answer to a request never sent
            await writer.drain()

    async def run() -> None:
        async with serving(late) as (pool, opened):
            for _ in range(2):
                response = await pool.request("GET", "/")
                assert await response.read() == b"{}"
                await asyncio.sleep(0.15)
            assert len(opened) == 2

    asyncio.run(run())


@pytest.mark.parametrize(
    ("head", "error"),
    [
        (b"transfer-encoding: gzip, chunked", "transfer coding"),
        (b"transfer-encoding: gzip", "transfer coding"),
        (b"content-length: 2\r\ntransfer-encoding: chunked", "Content-Length"),
        (b"content-length: 2\r\ncontent-length: 3", "Content-Length"),
    ],
)
def test_framing_it_does_not_read_is_refused(head: bytes, error: str) -> None:
    reply = b"HTTP/1.1 200 OK\r\n" + head + b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n"

    async def run() -> None:
        async with serving(lambda r, w: answer_each(r, w, reply)) as (pool, _):
            with pytest.raises(http1.FramingError, match=error):
                await (await pool.request("GET", "/")).read()

    asyncio.run(run())


def test_trailers_are_read_not_merged_into_the_headers() -> None:
    reply = CHUNKED + b"2\r\n{}\r\n0\r\nx-trailer: late\r\n\r\n"

    async def run() -> None:
        async with serving(lambda r, w: answer_each(r, w, reply)) as (pool, opened):
            for _ in range(2):
                response = await pool.request("GET", "/")
                assert await response.read() == b"{}"
                assert "x-trailer" not in response.headers
            assert len(opened) == 1  # a trailer is framing, not a fault

    asyncio.run(run())


def test_an_idle_connection_the_server_closed_is_replaced() -> None:
    async def one_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)  # keep-alive promised, then closed while idle
        await writer.drain()

    async def run() -> None:
        async with serving(one_answer) as (pool, connections):
            for _ in range(3):
                response = await pool.request("POST", "/", b"{}")
                assert await response.read() == b"{}"
                await asyncio.sleep(0.05)  # the close arrives before the next request
            assert len(connections) == 3

    asyncio.run(run())


def test_a_large_body_flows_with_reading_paused_and_resumed() -> None:
    size = 5 * http1.HIGH_WATER
    reply = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size + b"z" * size

    async def run() -> None:
        async with serving(lambda r, w: answer_each(r, w, reply)) as (pool, _):
            response = await pool.request("GET", "/")
            await asyncio.sleep(0.2)  # let the server fill the buffer past the high water
            assert len(await response.read()) == size

    asyncio.run(run())


def test_one_byte_chunks_pause_reading_by_what_they_hold() -> None:
    """A piece buffered costs more than its bytes: a flood of 1-byte chunks pauses reading
    long before a megabyte of pieces (~50 MiB of objects) is held."""
    count = 300_000
    reply = CHUNKED + b"1\r\na\r\n" * count + b"0\r\n\r\n"

    async def run() -> None:
        async with serving(lambda r, w: answer_each(r, w, reply)) as (pool, _):
            response = await pool.request("GET", "/")
            await asyncio.sleep(0.3)  # the server has written it all
            assert len(response._connection.body) < 100_000
            assert await response.read() == b"a" * count

    asyncio.run(run())


def test_refused_connections_are_connect_errors() -> None:
    async def run() -> None:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        pool = http1.Pool(f"http://127.0.0.1:{port}", {}, 1.0)
        with pytest.raises(http1.ConnectError, match="cannot connect"):
            await pool.request("GET", "/")

    asyncio.run(run())


def test_only_http_urls() -> None:
    with pytest.raises(ValueError, match="not an http"):
        http1.Pool("ftp://host/", {}, 1.0)
