"""Serve an app under uvicorn, draining on SIGTERM (or Ctrl-C) before a clean exit 0.

On the signal: readiness flips to not-ready and listen streams end at once (``begin_drain``),
uvicorn stops accepting and closes idle connections, in-flight requests get up to the drain
timeout to finish, and whatever still runs then is cancelled (a cancelled generation frees its
KV blocks at the engine's next step). uvicorn re-raises a caught signal after shutting down,
which would kill the process before the engine is stopped; kvgate returns normally instead.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from kvgate.gateway.http.limits import LimitedHttpToolsProtocol
from kvgate.gateway.settings import Settings

DRAIN_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How long a thread holding the GIL may keep it while another waits (Python's default: 5 ms).
# A server's threads — the event loop, the engine's step threads, the prepare pool working
# through a 1 MiB body in pure Python — take turns at it; at 5 ms a stream waited up to
# 0.66 s between chunks behind one such body (benchmarks.hostile), at 0.2 ms 0.12 s, with
# no cost measured on benchmarks/openai.py (c=1, c=16) in the same run.
GIL_SWITCH_INTERVAL_S = 0.0002
log = logging.getLogger("kvgate")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, begin_drain: Callable[[], None]) -> None:
        super().__init__(config)
        self._begin_drain = begin_drain

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            log.info(
                "%s: draining, in-flight requests have %.0f s to finish",
                signal.Signals(sig).name,
                self.config.timeout_graceful_shutdown or 0,
            )
            self._begin_drain()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's, without re-raising the signal once the server has stopped."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in DRAIN_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def http_protocol(settings: Settings) -> Any:
    """uvicorn's ``http`` protocol with kvgate's header size and header time limits."""
    return functools.partial(
        LimitedHttpToolsProtocol,
        max_header_bytes=settings.max_header_bytes,
        header_timeout_s=settings.header_timeout_s,
    )


def serve_app(
    app: Any,
    host: str,
    port: int,
    drain_timeout_s: float,
    *,
    uvicorn_logging: bool = True,
    http: Any = "auto",
    sockets: list[socket.socket] | None = None,
) -> None:
    """Run until SIGTERM/SIGINT, then drain; ``uvicorn_logging`` False leaves the log setup
    to the caller (JSON logs); ``http`` is uvicorn's protocol (see ``http_protocol``);
    ``sockets`` already listening are served instead of binding ``host:port`` (workers)."""
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # process-wide: this process serves HTTP
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        # uvicorn waits on this with asyncio.wait_for: a float works as well as its int hint
        timeout_graceful_shutdown=drain_timeout_s,  # type: ignore[arg-type]
        http=http,
        log_config=LOGGING_CONFIG if uvicorn_logging else None,
    )
    DrainingServer(config, app.state.begin_drain).run(sockets=sockets)
