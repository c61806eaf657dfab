"""The embedded engine in a process of its own, started and watched by ``kvgate serve``.

The engine (``kvgate.engine.process.core_process``) computes with every usable core and no event loop in its
process; the API processes (one, or ``--workers N``) tokenize, template, detokenize and
answer HTTP, each over a Unix socket to it (``kvgate.engine.process.core_client``). The socket and the
engine's settings live in a folder only this user can open, removed when serving ends.

While it starts, the engine writes each step as it begins (loading the model, allocating the KV
cache) to a pipe; ``wait_ready`` passes them on, for ``kvgate serve`` to show.

The engine asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``), so no
engine outlives a ``kvgate serve`` killed with SIGKILL. One that dies while serving is started
again after a pause that doubles with each quick death (``BACKOFF_FIRST_S`` up to
``BACKOFF_MAX_S``; an engine that ran ``STEADY_S`` starts the count again); one that cannot
load its model at all (exit ``FATAL``) is not.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kvgate")
FATAL = 2  # kvgate.engine.process.core_process: the model cannot be loaded
BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
STEADY_S = 60.0
STOP_TIMEOUT_S = 10.0  # SIGTERM, then SIGKILL
POLL_S = 0.05


class EngineSupervisor:
    def __init__(
        self, config: Any, adapters: list[tuple[str, str]], log_format: str = "text"
    ) -> None:
        """``config``: an ``engine.EngineConfig``; ``adapters`` (name, path) are loaded at
        every start (``--lora-modules``); the engine logs as ``--log-format`` says."""
        self.folder = tempfile.mkdtemp(prefix="kvgate-engine-")  # mode 0700
        self.socket_path = os.path.join(self.folder, "kvgate.engine.sock")
        self._config_path = os.path.join(self.folder, "config.pickle")
        with open(self._config_path, "wb") as file:
            pickle.dump((config, adapters, log_format), file)
        self.process: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self._failures = 0
        self._started_at = 0.0
        self._wake = threading.Event()
        self._phases: int | None = None  # the read end of the running engine's phase pipe

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def start(self) -> int:
        """Start the engine process (it appears on ``socket_path`` once it serves)."""
        try:
            os.unlink(self.socket_path)  # a dead engine's: API processes must not find it
        except FileNotFoundError:
            pass
        self._close_phases()
        self._phases, phases = os.pipe()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvgate.engine.process.core_process",
                self.socket_path,
                self._config_path,
                str(os.getpid()),
                str(phases),
            ],
            process_group=0,  # a terminal's Ctrl-C reaches the parent, which decides
            pass_fds=(phases,),
        )
        os.close(phases)
        self._started_at = time.monotonic()
        return self.process.pid

    def wait_ready(
        self, timeout_s: float, on_phase: Callable[[str, str], None] = lambda name, what: None
    ) -> int | None:
        """None once the engine serves; else its exit code (or -1 past ``timeout_s``).
        ``on_phase(name, what)`` hears each step of its start as it begins."""
        deadline = time.monotonic() + timeout_s
        assert self.process is not None
        pending = b""
        while not os.path.exists(self.socket_path):
            code = self.process.poll()
            if code is not None:
                return code
            if time.monotonic() > deadline:
                return -1
            pending = self._read_phases(pending, on_phase)
        return None

    def _read_phases(self, pending: bytes, on_phase: Callable[[str, str], None]) -> bytes:
        """Wait up to ``POLL_S`` for phase lines; pass on the whole ones, return the rest."""
        if self._phases is None or not select.select([self._phases], [], [], POLL_S)[0]:
            time.sleep(POLL_S if self._phases is None else 0)
            return pending
        data = os.read(self._phases, 4096)
        if not data:  # the engine closed it: its start is done (or it died)
            self._close_phases()
        *lines, pending = (pending + data).split(b"\n")
        for line in lines:
            name, _, what = line.decode(errors="replace").partition("\t")
            on_phase(name, what)
        return pending

    def _close_phases(self) -> None:
        if self._phases is not None:
            os.close(self._phases)
            self._phases = None

    def restart_delay(self, exit_code: int) -> float | None:
        """How long to wait before starting it again; None: not again (stopping, or it
        cannot load its model)."""
        if self.stopping or exit_code == FATAL:
            return None
        quick = time.monotonic() - self._started_at < STEADY_S
        self._failures = self._failures + 1 if quick else 0
        return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2.0 ** max(0, self._failures - 1))

    def watch(self, on_fatal: Callable[[], None]) -> threading.Thread:
        """A thread restarting the engine whenever it dies (one API process: it is the
        engine's parent); ``on_fatal`` if it cannot be started again."""

        def run() -> None:
            while not self.stopping:
                assert self.process is not None
                code = self.process.wait()
                delay = self.restart_delay(code)
                if delay is None:
                    if not self.stopping:
                        log.error("the engine process exited with %d: not starting it again", code)
                        on_fatal()
                    return
                log.warning(
                    "the engine process exited with %d: starting it again in %.1f s", code, delay
                )
                if self._wake.wait(delay):
                    return
                self.start()

        thread = threading.Thread(target=run, name="kvgate-engine-watch", daemon=True)
        thread.start()
        return thread

    def exited(self, exit_code: int) -> bool:
        """The supervisor reaped it: wait out the backoff (unless stopping) and start it
        again; False when it is not to be started again."""
        delay = self.restart_delay(exit_code)
        if delay is None:
            return self.stopping
        log.warning(
            "the engine process exited with %d: starting it again in %.1f s", exit_code, delay
        )
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and not self.stopping:
            time.sleep(POLL_S)
        if not self.stopping:
            self.start()
        return True

    def stop(self) -> None:
        """Stop the engine (SIGTERM, SIGKILL past ``STOP_TIMEOUT_S``) and remove its folder."""
        self.stopping = True
        self._wake.set()
        process = self.process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._close_phases()
        shutil.rmtree(self.folder, ignore_errors=True)
