"""Give freed memory back to the OS after a large request (glibc keeps it otherwise).

A ~1 MiB body parsed into Python objects, then freed, leaves glibc's heap grown: RSS stays
higher long after the answer (measured with ``benchmarks.hostile``: three 1 MiB bodies kept
+6.3 MiB, three of 30k short chat messages +23 MiB; with this, +3.2 and +17 MiB — the rest is
Python's own object arenas). ``malloc_trim(0)`` returns the free pages. It runs on a worker
thread (ctypes releases the GIL) once a request whose body was large has finished, one trim
at a time (a request ending meanwhile gets one more after it). Without glibc it is a no-op.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvgate.engine.memory import glibc

TRIM_BODY_BYTES = 256 * 1024  # smaller bodies leave too little behind to be worth a trim


def malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    return glibc("malloc_trim")


class TrimAfterLargeBodies:
    """ASGI middleware: ``malloc_trim(0)`` once a request with a large body has finished."""

    def __init__(self, app: ASGIApp, min_bytes: int = TRIM_BODY_BYTES) -> None:
        self.app = app
        self.min_bytes = min_bytes
        self.trim = malloc_trim()
        self.trims = 0  # trims done (for tests)
        self._trimming: asyncio.Future[int] | None = None
        self._again = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.trim is None:
            await self.app(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            return message

        try:
            await self.app(scope, counted, send)
        finally:
            if received >= self.min_bytes:
                if self._trimming is None:
                    self._start()
                else:
                    self._again = True

    def _start(self) -> None:
        assert self.trim is not None
        self._trimming = asyncio.ensure_future(asyncio.to_thread(self.trim, 0))
        self._trimming.add_done_callback(self._done)

    def _done(self, _: asyncio.Future[int]) -> None:
        self._trimming = None
        self.trims += 1
        if self._again:
            self._again = False
            self._start()
