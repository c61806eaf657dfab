"""A real kvgate app on a free port in a background thread, over one shared engine.

Tests talk to it over real sockets (httpx, the official SDK, curl-like raw requests), so
disconnects, SSE framing and headers behave exactly as in production.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Coroutine
from typing import Any

import uvicorn

from kvgate.gateway.app import create_app
from kvgate.gateway.http.serving import http_protocol
from kvgate.gateway.settings import Settings


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LiveServer:
    def __init__(self, engine: Any, backend: Any = None, **settings: Any) -> None:
        self.port = free_port()
        self.settings = Settings(port=self.port, **settings)
        self.app = create_app(self.settings, engine, backend=backend)
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.base = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            access_log=False,
            http=http_protocol(self.settings),
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self.loop: asyncio.AbstractEventLoop | None = None

    def __enter__(self) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        self.loop = self.run(_running_loop())
        return self

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run a coroutine on the server's event loop (for its discovery cache and the like)."""
        loop = self.loop or _loop_of(self._server)
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout=10)

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


async def _running_loop() -> asyncio.AbstractEventLoop:
    return asyncio.get_running_loop()


def _loop_of(server: uvicorn.Server) -> asyncio.AbstractEventLoop:
    for task_server in getattr(server, "servers", []):
        return task_server.get_loop()
    raise RuntimeError("the test server has no event loop yet")
