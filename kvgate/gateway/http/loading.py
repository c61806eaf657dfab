"""What the port answers while the server loads, so that it is bound, and says so, from the start.

``kvgate serve`` binds its listening sockets before it loads anything (a busy port fails at
once), and until the app takes them over this responder answers on them: ``/healthz`` 200,
the process is alive (``{"status": "ok", "loading": "model 2/4"}``); ``/readyz`` 503 with what
is loading (``{"ready": false, "loading": "model 2/4"}``); anything else 503 with
``Retry-After: 1`` and a JSON error: vLLM's ``/health`` too, which routers and fleet gateways
read as "can serve". One request per connection (``Connection: close``), nothing read past its head.

It runs its own event loop in a thread, over duplicates of the sockets' descriptors: stopping
it closes those alone, so the listening sockets stay open for the app and a connection made
in between waits in their backlog rather than being refused.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import orjson

HEAD_TIMEOUT_S = 5.0  # a client that has not sent its request head by then is dropped
FINISH_TIMEOUT_S = 1.0  # answers under way when stopped get this long to be written


def response(path: str, loading: str) -> bytes:
    """The whole HTTP response to a request for ``path`` while ``loading``."""
    headers = ""
    body: dict[str, Any]
    if path == "/healthz":
        status, body = "200 OK", {"status": "ok", "loading": loading}
    elif path == "/readyz":
        status, body = "503 Service Unavailable", {"ready": False, "loading": loading}
    else:
        status, headers = "503 Service Unavailable", "Retry-After: 1\r\n"
        message = f"kvgate is starting ({loading}); retry in a moment"
        body = {"error": {"message": message, "type": "unavailable", "code": 503}}
    content = orjson.dumps(body)
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{headers}"
        f"Content-Length: {len(content)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + content


class LoadingResponder:
    """Answers on ``sockets`` from `start` to `stop`; ``loading()`` says what is loading."""

    def __init__(self, sockets: list[socket.socket], loading: Callable[[], str]) -> None:
        self.sockets = sockets
        self.loading = loading
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._serving = threading.Event()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvgate-loading", daemon=True)
        self._thread.start()
        self._serving.wait()

    def stop(self) -> None:
        """Stop answering (at once; answers under way are finished); the sockets stay open.
        Idempotent."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        thread.join()

    def _run(self) -> None:
        asyncio.run(self._serve())

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        answering: set[asyncio.Task[None]] = set()

        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            answering.add(task)
            try:
                await self._answer(reader, writer)
            finally:
                answering.discard(task)

        servers = []
        try:
            for sock in self.sockets:
                duplicate = socket.socket(fileno=os.dup(sock.fileno()))
                servers.append(await asyncio.start_server(answer, sock=duplicate))
        finally:
            self._serving.set()
        await self._stop.wait()
        for server in servers:
            server.close()  # closes the duplicates: the listening sockets stay open
        if answering:
            await asyncio.wait(answering, timeout=FINISH_TIMEOUT_S)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            target = head.split(b" ", 2)[1] if head.count(b" ") >= 2 else b"/"
            path = target.partition(b"?")[0].decode("latin-1")
            writer.write(response(path, self.loading()))
            await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # gone, too slow, or a head over 64 KiB: nothing to answer
        finally:
            writer.close()
