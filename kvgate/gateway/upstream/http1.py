"""A lean HTTP/1.1 keep-alive client for the fleet's upstream calls, over httptools' parser.

Why not aiohttp (or httpx): on ``benchmarks/fleet.py --workload overhead`` (c=32 POSTs to
instant upstreams) the client's CPU per call was httpx 1.1 ms, aiohttp 0.12 ms, this 0.02 ms —
with the gateway's whole call at ~0.35 ms, aiohttp alone was a third of it. A fleet call needs
little of what they offer: one pool of keep-alive connections per upstream, a request written
as one buffer, the status, the headers and the body (by length, chunked or up to the close)
parsed by llhttp (``httptools``, which uvicorn uses too), the body handed over as it arrives.
No redirects, cookies, proxies or content decoding (upstream answers in a coding are refused
by the caller).

A connection goes back to the pool only once its response was read to the end and both
sides keep it alive; one closed early is closed, which aborts the request upstream. Idle
connections expire before the usual server keep-alive (uvicorn's 5 s). A pool opens at most
``max_connections`` at once: a request beyond them waits for one to come back. A request on
a reused connection that the server closed before answering is sent again, once, on a new
connection only where that cannot do it twice: a ``GET`` (idempotent), or any request whose
bytes provably never left (the connection was found closed as it was written). A ``POST``
that was written may have reached the upstream, and is not repeated here: the caller decides
(the fleet's call tries another upstream while it has yielded nothing).

The upstream is outside data, so its framing is bounded as the bytes arrive, not once a
piece is complete (httptools buffers a header's value until its line ends, growing it by
concatenation): at most ``MAX_FRAMING_BYTES`` are fed to the parser without a body byte
among them (the status line and headers; a chunk's size line and extensions; trailers),
at most ``MAX_HEADERS`` header lines, and the connection is closed at once past either.
A response is delimited by its own framing and nothing after it is read: bytes that come
after a complete response (a second response in the same write, bytes past its
Content-Length, anything on an idle connection) or before the request close the connection,
and none of them reaches a caller. A transfer coding other than ``chunked`` is refused, as
llhttp refuses Content-Length beside one.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from typing import cast
from urllib.parse import urlsplit

import httptools

IDLE_EXPIRY_S = 4.0  # below uvicorn's (so vLLM's and kvgate's) 5 s keep-alive timeout
HIGH_WATER = 1 << 20  # body bytes buffered before reading pauses
PIECE_BYTES = 64  # what a buffered piece costs beyond its bytes (a flood of 1-byte chunks)
MAX_FRAMING_BYTES = 64 << 10  # the head, and any framing between two body bytes
MAX_HEADERS = 128  # header lines in a response (interim ones and trailers included)
MAX_CACHED_HEADS = 64  # request heads kept built (a method and path each; a fleet uses ~5)
# Connections one pool has in use at once, by default: vLLM's largest default batch
# (``max_num_seqs`` 1024 on an H100-class GPU); calls beyond it would only queue upstream.
MAX_CONNECTIONS = 1024
IDEMPOTENT = frozenset(("GET", "HEAD", "OPTIONS"))  # safe to send twice (RFC 9110 9.2.2)


class ConnectError(OSError):
    """The upstream could not be reached (refused, unresolvable, TLS failed, timed out)."""


class FramingError(OSError):
    """The upstream's bytes are not HTTP/1.1 as this client reads it, or it closed early."""


class _Connection(asyncio.Protocol):
    """One TCP connection and the response being read on it (at most one at a time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.lost = loop.create_future()  # done once the transport is gone (``Pool.aclose``)
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.header_lines = 0
        self.framing = 0  # bytes fed since the last body byte
        self.body_bytes = 0
        self.expecting = False  # a request was sent and its answer is not complete yet
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.received_any = False
        self.unsent = False  # the request's bytes never left: the connection was closed first
        self.body: deque[bytes] = deque()
        self.buffered = 0
        self.paused = False
        self.error: FramingError | None = None  # never raised itself: see raised()
        self.waiter: asyncio.Future[bool] | None = None  # True: news; False: silence

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass of it

    def data_received(self, data: bytes) -> None:
        if not self.expecting:
            self._unasked()
            return
        self.received_any = True
        view = memoryview(data)
        try:
            # Fed in pieces that end where the framing bound would be reached, so the
            # parser never holds more than it allows.
            while view and self.expecting:
                room = MAX_FRAMING_BYTES - self.framing
                piece, view = view[:room], view[room:]
                body = self.body_bytes
                self.parser.feed_data(piece)
                carried = self.body_bytes - body
                self.framing = len(piece) - carried if carried else self.framing + len(piece)
                if self.framing >= MAX_FRAMING_BYTES and self.expecting:
                    self._refuse(f"over {MAX_FRAMING_BYTES} bytes of headers or framing")
                    return
        except httptools.HttpParserError as exc:
            if self.complete:  # what follows the answer is not read
                self._unasked()
            else:
                self._refuse(str(exc))
            return
        if view:  # bytes after the complete answer
            self._unasked()
        elif self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.lost.done():
            self.lost.set_result(None)
        if self.headers_done and not self.complete and self._until_close():
            self.complete = True  # a body delimited by the close itself
            self._wake()
        elif not self.complete:
            self._fail(FramingError(f"the upstream closed the connection ({exc or 'EOF'})"))

    def eof_received(self) -> bool | None:
        return None  # close the transport: connection_lost follows

    # -- httptools callbacks ---------------------------------------------------------------

    def on_message_begin(self) -> None:
        if not self.expecting:  # a second response in the same read: the parser stops here
            raise httptools.HttpParserError("a response nobody asked for")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_lines += 1
        if self.header_lines > MAX_HEADERS:
            self._refuse(f"over {MAX_HEADERS} header lines")
            raise httptools.HttpParserError("too many headers")
        if self.headers_done:  # a trailer: read (and bounded), never merged into the headers
            return
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        previous = self.headers.get(key)
        self.headers[key] = text if previous is None else f"{previous}, {text}"

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if 100 <= self.status < 200:  # an interim answer: the real one follows
            self.headers = {}
            return
        coding = self.headers.get("transfer-encoding")
        if coding is not None and coding.strip().lower() != "chunked":
            self._refuse(f"transfer coding {coding!r:.64}")
            raise httptools.HttpParserError("a transfer coding")
        self.headers_done = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.body_bytes += len(body)
        self.buffered += len(body) + PIECE_BYTES
        self._wake()

    def on_message_complete(self) -> None:
        if 100 <= self.status < 200:
            return
        self.complete = True
        self.expecting = False
        self.keep_alive = self.parser.should_keep_alive()  # known only until the next one
        self._wake()

    # -- the reading side --------------------------------------------------------------------

    def _until_close(self) -> bool:
        return "content-length" not in self.headers and "chunked" not in self.headers.get(
            "transfer-encoding", ""
        )

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    def _refuse(self, why: str) -> None:
        """The upstream's bytes are not an answer this client reads: the call fails, the
        connection is closed at once."""
        self._fail(FramingError(f"malformed HTTP from the upstream: {why}"))
        self.close()

    def _unasked(self) -> None:
        """Bytes no request asked for: the connection is closed and they are dropped; a
        complete answer stands, one not begun fails."""
        if not self.complete:
            self._fail(FramingError("the upstream sent bytes before it was asked"))
        self.close()

    def send(self, data: bytes) -> None:
        """Write a request; its answer is expected from here on. ``unsent`` once the
        connection turns out closed before the bytes left: a transport already closing, or a
        write the kernel refused at once (a reset that came while the connection was idle;
        asyncio then closes the transport before ``write`` returns, nothing of it sent)."""
        if self.error is not None:  # the upstream spoke first
            raise self.raised()
        transport = self.transport
        assert transport is not None
        self.expecting = True
        if self.closed or transport.is_closing():
            self.unsent = True
            raise ConnectionResetError("the connection was closed before the request")
        transport.write(data)
        self.unsent = transport.is_closing()

    def _fail(self, exc: FramingError) -> None:
        if self.error is None:
            self.error = exc
        self._wake()

    def raised(self) -> FramingError:
        """The connection's error as a new exception. The one kept is never raised: raised,
        it would hold the frames it passed through, one of them holding this connection — a
        cycle keeping the call's buffers until the cyclic GC runs. For the same reason the
        waiter only ever gets a result."""
        assert self.error is not None
        return FramingError(*self.error.args)

    async def wait(self, timeout_s: float | None) -> None:
        """Until the parser has news (headers, body, the end, an error: the next wait raises
        it) or ``timeout_s`` of silence."""
        if self.error is not None:
            raise self.raised()
        waiter = self.waiter = self.loop.create_future()
        timer = None
        if timeout_s is not None:
            timer = self.loop.call_later(timeout_s, _expire, waiter)
        try:
            news = await waiter
        finally:
            self.waiter = None
            if timer is not None:
                timer.cancel()
        if not news:
            raise TimeoutError("no data from the upstream within the read timeout")

    def take(self) -> bytes | None:
        """The body bytes buffered so far (None: none yet), reading resumed if paused."""
        if not self.body:
            return None
        data = self.body.popleft() if len(self.body) == 1 else b"".join(self.body)
        self.body.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        return self.complete and not self.closed and self.error is None and self.keep_alive

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def forget(self) -> None:
        """Drop what a discarded connection holds now: the parser's callbacks make it a
        reference cycle, freed only when the cyclic GC runs, and the old parser holds a
        partial header (up to ``MAX_FRAMING_BYTES``), the deque an unread body."""
        self.parser = httptools.HttpResponseParser(self)
        self.body.clear()
        self.buffered = 0


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


class Response:
    """An upstream's answer: status and headers read, the body as it comes. ``close`` (or
    reading it to the end) gives the connection back; it is safe to call twice."""

    def __init__(self, pool: Pool, connection: _Connection, read_timeout_s: float | None):
        self._pool, self._connection = pool, connection
        self._read_timeout_s = read_timeout_s
        self.status = connection.status
        self.headers: Mapping[str, str] = connection.headers  # names in lower case
        self._released = False

    @property
    def content_length(self) -> int | None:
        value = self.headers.get("content-length")
        return int(value) if value is not None and value.isdigit() else None

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's pieces as they arrive (each wait bounded by the read timeout)."""
        connection = self._connection
        try:
            while True:
                data = connection.take()
                if data is not None:
                    yield data
                elif connection.complete:
                    break
                else:
                    await connection.wait(self._read_timeout_s)
        finally:
            self.close()

    async def read(self) -> bytes:
        pieces = [piece async for piece in self.chunks()]
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def close(self) -> None:
        if self._released:
            return
        self._released = True
        self._pool.release(self._connection)


class Pool:
    """Keep-alive connections to one upstream (``scheme://host:port``): at most
    ``max_connections`` in use at once (a request beyond them waits for one to be given
    back), and only as many open as were ever in use together."""

    def __init__(
        self,
        url: str,
        headers: Mapping[str, str],
        connect_timeout_s: float,
        body_type: str | None = None,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        """``headers`` go on every request, ``body_type`` as the content type of those that
        carry a body."""
        if max_connections < 1:
            raise ValueError("max_connections must be at least 1")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or parts.hostname is None:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        host = self.host if ":" not in self.host else f"[{self.host}]"
        authority = host if parts.port is None else f"{host}:{parts.port}"
        self._common = "".join(f"{k}: {v}\r\n" for k, v in {"host": authority, **headers}.items())
        self._typed = "" if body_type is None else f"content-type: {body_type}\r\n"
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        # A connection in use holds one: none is opened while another is idle, so the open
        # ones are at most those in use (a connection goes idle only when given back).
        self._in_use = asyncio.Semaphore(max_connections)
        self._heads: dict[tuple[str, str, bool], bytes] = {}

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        read_timeout_s: float | None = None,
    ) -> Response:
        """Send the request and return once the status and headers are in (ConnectError,
        FramingError, another OSError or TimeoutError otherwise)."""
        data = self._head(method, path, headers, len(body)) + body
        await self._in_use.acquire()
        try:
            connection, reused = await self._acquire()
            try:
                return await self._exchange(connection, data, read_timeout_s)
            except (FramingError, ConnectionError):
                if not (reused and _resendable(connection, method)):
                    raise
            # The server closed an idle connection as we sent on it: once more, on a new one.
            connection = await self._connect()
            return await self._exchange(connection, data, read_timeout_s)
        except BaseException:
            self._in_use.release()
            raise

    async def _exchange(
        self, connection: _Connection, data: bytes, read_timeout_s: float | None
    ) -> Response:
        try:
            connection.send(data)
            while not connection.headers_done:
                await connection.wait(read_timeout_s)
        except BaseException:
            self._discard(connection)
            raise
        return Response(self, connection, read_timeout_s)

    def _head(
        self, method: str, path: str, headers: Mapping[str, str] | None, length: int
    ) -> bytes:
        """The request line and headers; those without per-call headers built once."""
        cached = headers is None
        key = (method, path, length > 0)
        if cached:
            head = self._heads.get(key)
            if head is not None:
                return head + b"%d\r\n\r\n" % length
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        typed = self._typed if length else ""
        start = f"{method} {self.prefix}{path} HTTP/1.1\r\n{self._common}{typed}{extra}"
        head = f"{start}content-length: ".encode("latin-1")
        if cached and len(self._heads) < MAX_CACHED_HEADS:
            self._heads[key] = head
        return head + b"%d\r\n\r\n" % length

    async def _acquire(self) -> tuple[_Connection, bool]:
        now = time.monotonic()
        while self._idle:
            connection = self._idle.pop()
            if not connection.closed and now - connection.idle_since < IDLE_EXPIRY_S:
                connection._reset()
                return connection, True
            self._discard(connection)
        return await self._connect(), False

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(loop), self.host, self.port, ssl=self._ssl
                )
        except TimeoutError:
            raise ConnectError(
                f"cannot connect: timed out after {self.connect_timeout_s:g} s"
            ) from None
        except (OSError, ssl.SSLError) as exc:
            raise ConnectError(f"cannot connect ({type(exc).__name__}: {exc})") from None
        self._open.add(connection)
        return connection

    def release(self, connection: _Connection) -> None:
        """A response is done with ``connection``: pooled if it can serve another."""
        if connection.reusable():
            connection.idle_since = time.monotonic()
            self._idle.append(connection)
        else:
            self._discard(connection)
        self._in_use.release()

    def _discard(self, connection: _Connection) -> None:
        connection.close()
        connection.forget()
        self._open.discard(connection)

    async def aclose(self) -> None:
        """Close every connection (calls in flight fail), and return once they are gone."""
        closing = list(self._open)
        for connection in closing:
            if connection.transport is not None:
                connection.transport.abort()  # a close would wait for an unread write
            self._discard(connection)
        self._idle.clear()
        await asyncio.gather(*(connection.lost for connection in closing))


def _resendable(connection: _Connection, method: str) -> bool:
    """May a request that failed on a reused connection go again on a new one? Only if the
    upstream cannot have acted on it: nothing came back, and the request is idempotent or
    provably never left."""
    return not connection.received_any and (connection.unsent or method in IDEMPOTENT)
