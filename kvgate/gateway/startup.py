"""How ``kvgate serve`` starts like a server: the port first, an answer on it while loading,
numbered steps with their times, then the URLs and one command to try.

The listening sockets are bound before anything loads, so a busy port fails at once, naming
``--port`` and how to see who holds it. Until the app takes them over, `LoadingResponder`
answers on them (``/readyz``: what is loading, as ``"model 2/4"``). Each step is logged as it
ends, numbered, with its time: ``[2/4] loading model smollm2 (…gguf) … 3.1 s``.
"""

from __future__ import annotations

import logging
import shlex
import socket
import sys
import time
from types import TracebackType

import orjson

from kvgate.gateway.http.loading import LoadingResponder
from kvgate.gateway.http.workers import listening_sockets
from kvgate.gateway.settings import Settings

log = logging.getLogger("kvgate")
TRY_PROMPT = "What is the capital of France?"


def listen(settings: Settings) -> list[socket.socket]:
    """The ``--workers`` listening sockets on ``--host``:``--port``; a port that cannot be
    bound ends the process with a message saying what to do."""
    try:
        return listening_sockets(settings.host, settings.port, settings.workers)
    except OSError as exc:
        sys.exit(
            f"kvgate: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}; "
            f"choose another --port, or see which process holds it: "
            f"ss -ltnp 'sport = :{settings.port}'"
        )


def base_url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def try_command(base: str, model: str) -> str:
    """A curl asking the OpenAI door of ``base`` one question of ``model``."""
    body = {"model": model, "messages": [{"role": "user", "content": TRY_PROMPT}]}
    return (
        f"curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d {shlex.quote(orjson.dumps(body).decode())}"
    )


class Start:
    """The steps of one start (``total`` of them), and the answer on ``sockets`` meanwhile.

    As a context manager it answers from entry until `hand_over` or `ready` (or the exit,
    whatever ended the start)."""

    def __init__(self, sockets: list[socket.socket], total: int) -> None:
        self.total = total
        self.index, self.name, self.what = 0, "start", ""
        self.began = self._step_began = time.monotonic()
        self.responder = LoadingResponder(sockets, self.loading)

    def __enter__(self) -> Start:
        self.responder.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.responder.stop()

    def loading(self) -> str:
        """What ``/readyz`` says is loading: ``model 2/4``."""
        return f"{self.name} {self.index}/{self.total}"

    def step(self, name: str, what: str) -> None:
        """The previous step is done (logged with its time); ``what`` begins."""
        self._log_step()
        self.index += 1
        self.name, self.what, self._step_began = name, what, time.monotonic()

    def hand_over(self) -> None:
        """Stop answering: the app takes the sockets (connections wait in their backlog)."""
        self.responder.stop()

    def ready(self, settings: Settings, model: str) -> None:
        """The app is about to serve: log the last step, the URLs and a command to try."""
        self._log_step()
        self.hand_over()
        base = base_url(settings.host, settings.port)
        log.info(
            "ready in %.1f s: MCP %s/mcp, OpenAI-compatible API %s/v1",
            time.monotonic() - self.began,
            base,
            base,
        )
        log.info("try: %s", try_command(base, model))

    def _log_step(self) -> None:
        if self.index:
            elapsed = time.monotonic() - self._step_began
            log.info("[%d/%d] %s … %.1f s", self.index, self.total, self.what, elapsed)
