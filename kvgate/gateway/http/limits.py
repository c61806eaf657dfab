"""HTTP/1.1 limits uvicorn's httptools protocol lacks, so a client cannot hold memory or a
connection with an endless or ever-so-slow request head. Bodies are bounded by the endpoints.

- The request line plus headers may take ``max_header_bytes`` (431). The bound is enforced on
  the bytes handed to the parser, not on completed lines: the parser never holds more than the
  limit of one head (plus at most one read's worth right after a pipelined body), so a single
  endless header line costs neither memory nor repeated copying.
- The request target may take ``min(MAX_TARGET_BYTES, max_header_bytes // 2)`` bytes (414).
- The head must arrive within ``header_timeout_s`` of its first read (the first request's:
  of the connection's start) (408); a head that comes whole in one read, as nearly all do,
  arms no timer. A pipelined head that trickles in while an earlier request on the connection
  is served stops being read at its deadline and is answered 408 (and the connection closed)
  once that response is done.
- HTTP/1.1 requires exactly one ``Host`` (RFC 9112 section 3.2): none or several is 400.

Use it as uvicorn's ``http`` protocol: ``functools.partial(LimitedHttpToolsProtocol,
max_header_bytes=..., header_timeout_s=...)``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvgate.gateway.http.corking import CorkedTransport

MAX_TARGET_BYTES = 8192  # the request line limit most servers use (Apache, nginx buffers)


class HeadRejected(Exception):
    """Raised inside a parser callback: the parser stops and ``send_400_response`` answers."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(
        self, *args: Any, max_header_bytes: int, header_timeout_s: float, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.max_header_bytes = max_header_bytes
        self.max_target_bytes = min(MAX_TARGET_BYTES, max_header_bytes // 2)
        self.header_timeout_s = header_timeout_s
        self._in_head = True  # between a message's end (or the connection's start) and its head
        self._head_open = False  # a head's first byte has come, its end not yet
        self._head_bytes = 0
        self._target_bytes = 0
        self._head_expired = False  # a pipelined head missed its deadline behind a response
        self._header_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # A response's head and body in one send (the flow control keeps the raw transport).
        self.transport: CorkedTransport = CorkedTransport(transport, self.loop)  # type: ignore[assignment]
        self._start_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def eof_received(self) -> None:
        """The client sent FIN (closed, or half-closed after its request: the two look alike
        until a write fails, and uvicorn takes it as a disconnect, which cancels the call).
        An answer already complete but still corked is sent before the transport closes."""
        self.transport.flush()

    def data_received(self, data: bytes) -> None:
        """Hand the parser at most what is left of the head's allowance, then the rest only
        if the head completed within it."""
        if not self._in_head:
            super().data_received(data)
            return
        room = self.max_header_bytes - self._head_bytes
        self._head_bytes += min(len(data), room)
        if len(data) <= room:
            super().data_received(data)
            self._time_a_partial_head()
            return
        super().data_received(data[:room])
        if self._refusal is not None or self.transport.is_closing():
            return
        if self._in_head:
            self._refuse(431, f"request line and headers exceed {self.max_header_bytes} bytes")
            return
        self.data_received(data[room:])

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._target_bytes = 0
        self._head_open = True

    def _time_a_partial_head(self) -> None:
        """A head begun but not complete after this read: its deadline starts now. A head
        that comes whole in one read, the usual case, never arms a timer."""
        if self._head_open and self._header_timer is None and not self.transport.is_closing():
            self._start_header_timer()

    def on_url(self, url: bytes) -> None:
        self._target_bytes += len(url)
        if self._target_bytes > self.max_target_bytes:
            self._refusal = (414, f"request target exceeds {self.max_target_bytes} bytes")
            raise HeadRejected
        super().on_url(url)

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        self._head_open = False
        self._in_head = False
        hosts = sum(1 for name, _ in self.headers if name == b"host")
        if self.parser.get_http_version() == "1.1" and hosts != 1:
            self._refusal = (400, "an HTTP/1.1 request needs exactly one Host header")
            raise HeadRejected
        if hosts > 1:
            self._refusal = (400, "more than one Host header")
            raise HeadRejected
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True
        self._head_bytes = 0

    def on_response_complete(self) -> None:
        if self._head_expired and not self.transport.is_closing():
            self._head_expired = False
            self.server_state.total_requests += 1
            self._refuse_slow_head()
            return
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        """The parser stops on our exception and lands here: answer with the real status."""
        if self._refusal is None:
            super().send_400_response(msg)
            return
        self._refuse(*self._refusal)

    def _refuse(self, status: int, text: str) -> None:
        self._refusal = (status, text)
        self._cancel_header_timer()
        body = text.encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, _REASONS[status], len(body), body)
        )
        self.transport.close()

    def _start_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_too_slow)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.cycle is not None and not self.cycle.response_complete:
            # An earlier request is still being answered: read no more of this head, and
            # refuse it as soon as that response is done (cutting it short would punish the
            # earlier request for the later one).
            self._head_expired = True
            self.flow.pause_reading()
            return
        self._refuse_slow_head()

    def _refuse_slow_head(self) -> None:
        self._refuse(408, f"request headers not received within {self.header_timeout_s:g} s")


_REASONS = {
    400: b"Bad Request",
    408: b"Request Timeout",
    414: b"URI Too Long",
    431: b"Request Header Fields Too Large",
}
