"""HTTP/1.1 limits uvicorn's httptools protocol lacks: a cap on the request line plus headers
(431) and a deadline for them to arrive (408), so a client cannot hold memory or a connection
by sending an endless or ever-so-slow header block. Bodies are bounded by the MCP endpoint.

Use it as uvicorn's ``http`` protocol: ``functools.partial(LimitedHttpToolsProtocol,
max_header_bytes=..., header_timeout_s=...)``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class HeadersTooLarge(Exception):
    pass


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(
        self, *args: Any, max_header_bytes: int, header_timeout_s: float, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.max_header_bytes = max_header_bytes
        self.header_timeout_s = header_timeout_s
        self._header_bytes = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._refusal: tuple[int, str] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._start_header_timer()

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        """The parser stops on our exception and lands here: answer with the real status."""
        if self._refusal is None:
            super().send_400_response(msg)
            return
        status, text = self._refusal
        body = text.encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, _REASONS[status], len(body), body)
        )
        self.transport.close()

    def _count(self, size: int) -> None:
        self._header_bytes += size
        if self._header_bytes > self.max_header_bytes:
            self._refusal = (431, f"request line and headers exceed {self.max_header_bytes} bytes")
            raise HeadersTooLarge

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
            return  # a request is being served; its own limits apply
        self._refusal = (408, f"request headers not received within {self.header_timeout_s:g} s")
        self.send_400_response("")


_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}
