"""The upstream client's pool: what it sends again, how many connections it opens, what it
keeps, how it closes. Raw servers on loopback: asyncio ones, and a blocking one in a thread
where the test must hold the client's event loop still while the server acts."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from kvgate.gateway.upstream import http1
from tests.gateway.upstream.test_http1 import OK, Handler, read_request, serving


def answer_once_then_hang_up(seen: list[bytes]) -> Handler:
    """Answer the first request (keep-alive promised); read the next one whole, then close
    without answering: the upstream got it, and may have acted on it."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(OK)
        await writer.drain()
        seen.append(await read_request(reader))

    return handler


def test_a_post_that_reached_the_upstream_is_not_sent_again() -> None:
    seen: list[bytes] = []

    async def run() -> None:
        async with serving(answer_once_then_hang_up(seen)) as (pool, connections):
            await (await pool.request("POST", "/v1/completions", b"{}")).read()
            with pytest.raises(http1.FramingError, match="closed the connection"):
                await pool.request("POST", "/v1/completions", b"{}")
            assert len(connections) == 1  # no second connection: not sent again

    asyncio.run(run())
    assert len(seen) == 2


def test_a_get_on_a_connection_closed_under_it_is_sent_again() -> None:
    seen: list[bytes] = []

    async def run() -> None:
        async with serving(answer_once_then_hang_up(seen)) as (pool, connections):
            await (await pool.request("GET", "/health")).read()
            response = await pool.request("GET", "/health")  # idempotent: once more
            assert await response.read() == b"{}"
            assert len(connections) == 2

    asyncio.run(run())


@contextmanager
def resetting_server() -> Iterator[tuple[int, threading.Event, list[bytes]]]:
    """A blocking server in a thread: it answers its first connection's first request, then,
    once ``reset`` is set, resets that connection (RST, not FIN); every later connection is
    answered request by request."""
    listener = socket.create_server(("127.0.0.1", 0))
    reset, seen = threading.Event(), []

    def serve() -> None:
        first, _ = listener.accept()
        seen.append(first.recv(65536))
        first.sendall(OK)
        reset.wait(10)
        first.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        first.close()
        second, _ = listener.accept()
        with second:
            seen.append(second.recv(65536))
            second.sendall(OK)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1], reset, seen
    finally:
        listener.close()
        thread.join(10)


def test_a_post_that_never_left_is_sent_again_on_a_new_connection() -> None:
    """The upstream reset an idle connection; the client's loop has not read the reset yet
    (it is held still), so the POST is written on it: the kernel refuses the bytes at once,
    nothing of the request left, and it goes again on a new connection."""
    with resetting_server() as (port, reset, seen):

        async def run() -> None:
            pool = http1.Pool(f"http://127.0.0.1:{port}", {}, 2.0)
            try:
                await (await pool.request("POST", "/v1/completions", b"{}")).read()
                reset.set()
                threading.Event().wait(0.3)  # the loop held: the reset arrives, unread
                response = await pool.request("POST", "/v1/completions", b"{}")
                assert await response.read() == b"{}"
            finally:
                await pool.aclose()

        asyncio.run(run())
    assert len(seen) == 2 and all(request.startswith(b"POST") for request in seen)


def test_at_most_max_connections_are_open_and_the_rest_wait() -> None:
    limit, calls = 3, 7
    open_now, most = [0], [0]

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        open_now[0] += 1
        most[0] = max(most[0], open_now[0])
        try:
            while True:
                try:
                    await read_request(reader)
                except asyncio.IncompleteReadError:
                    return
                await asyncio.sleep(0.1)
                writer.write(OK)
                await writer.drain()
        finally:
            open_now[0] -= 1
            writer.close()

    async def run() -> None:
        server = await asyncio.start_server(slow, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = http1.Pool(f"http://127.0.0.1:{port}", {}, 2.0, max_connections=limit)

        async def call() -> bytes:
            return await (await pool.request("POST", "/v1/completions", b"{}")).read()

        try:
            assert await asyncio.gather(*(call() for _ in range(calls))) == [b"{}"] * calls
        finally:
            await pool.aclose()
            server.close()
            await server.wait_closed()

    asyncio.run(run())
    assert most[0] == limit


def test_the_head_cache_stays_bounded() -> None:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                request = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            path = request.split(b" ")[1]
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(path), path))
            await writer.drain()

    async def run() -> None:
        async with serving(answer) as (pool, _):
            for i in range(http1.MAX_CACHED_HEADS * 2):
                response = await pool.request("GET", f"/page/{i}")
                assert await response.read() == f"/page/{i}".encode()
            assert len(pool._heads) == http1.MAX_CACHED_HEADS
            response = await pool.request("GET", "/page/0")  # a cached head, reused
            assert await response.read() == b"/page/0"

    asyncio.run(run())


def test_aclose_returns_once_every_connection_is_gone() -> None:
    async def run() -> None:
        async with serving(lambda r, w: r.read()) as (pool, _):
            pending = asyncio.ensure_future(pool.request("GET", "/never-answered"))
            await asyncio.sleep(0.1)
            (connection,) = pool._open
            await pool.aclose()
            assert connection.lost.done() and connection.closed
            with pytest.raises(http1.FramingError):
                await pending

    asyncio.run(run())
