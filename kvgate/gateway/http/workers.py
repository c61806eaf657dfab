"""``--workers N``: N HTTP processes serving one port.

The parent binds N listening sockets on the port with ``SO_REUSEPORT`` (the kernel spreads new
connections over them by their addresses, so 32 connections opened at once land on every
worker, where one shared socket lets the first awake process accept them all), then forks one
worker per socket. Each worker builds its own app (in fleet mode: its own ring over the same
upstreams, so routing is the same in every worker, as it is in every gateway) and serves its
socket under uvicorn with kvgate's SIGTERM drain.

The parent only supervises: SIGTERM or SIGINT is forwarded to every worker as SIGTERM (each
drains, then exits 0) and waited for; a worker that dies on its own is started again. Workers
ask the kernel for SIGTERM when the parent dies (``PR_SET_PDEATHSIG``), so a parent killed
with SIGKILL leaves no orphan serving the port.

With an embedded engine the parent also starts the engine's own process
(``kvgate.gateway.engine_supervisor``) before the workers, and every worker connects to it: it is
restarted with backoff when it dies, and stopped after the workers have drained.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvgate.gateway.engine_supervisor import EngineSupervisor

log = logging.getLogger("kvgate")
PR_SET_PDEATHSIG = 1
FATAL = 2  # a worker's startup error (a bad flag, no upstream): no use starting it again
RESTART_PAUSE_S = 1.0  # between restarts of a worker that keeps dying


def listening_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` sockets listening on ``host:port`` together (``SO_REUSEPORT``; one alone
    without it, so that another server's port is an error, not a port shared with it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if count > 1:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]  # port 0: the others join the one the first got
            sock.listen(2048)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def die_with_parent(parent: int) -> None:
    """SIGTERM this process when its parent dies (Linux); exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)


class Supervisor:
    """Forks a worker per socket, forwards the stop signals, restarts a worker that died;
    with an ``engine`` (``kvgate.gateway.engine_supervisor``), restarts it too, with its backoff, and
    stops it once every worker has drained."""

    def __init__(
        self,
        sockets: list[socket.socket],
        work: Callable[[socket.socket, int], None],
        engine: EngineSupervisor | None = None,
    ):
        self.sockets = sockets
        self.work = work
        self.engine = engine
        self.children: dict[int, int] = {}  # pid → worker index
        self.stopping = False

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        for index in range(len(self.sockets)):
            self._fork(index)
        log.info("%d workers serving (pids %s)", len(self.children), sorted(self.children))
        status = 0
        while self.children:
            try:
                pid, code = os.wait()
            except ChildProcessError:
                break
            except InterruptedError:  # pragma: no cover - PEP 475 retries os.wait
                continue
            exit_code = os.waitstatus_to_exitcode(code)
            if self.engine is not None and pid == self.engine.pid:
                if not self.engine.exited(exit_code) and not self.stopping:
                    self._stop(signal.SIGTERM, None)  # no engine: nothing to serve
                    status = FATAL
                continue
            index = self.children.pop(pid, -1)
            if index < 0:
                continue
            if exit_code == FATAL and not self.stopping:
                self._stop(signal.SIGTERM, None)
                status = FATAL
            if self.stopping:
                status = status or max(exit_code, 0)
                continue
            log.warning(
                "worker %d (pid %d) exited with %d: starting it again", index, pid, exit_code
            )
            time.sleep(RESTART_PAUSE_S)
            if not self.stopping:
                self._fork(index)
        if self.engine is not None:  # after the workers' drain: their calls needed it
            self.engine.stop()
        return status

    def _fork(self, index: int) -> None:
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the worker
            code = 1
            try:
                die_with_parent(parent)
                for sig in (signal.SIGTERM, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                os.setpgid(0, 0)  # a terminal's Ctrl-C reaches the parent, which forwards it
                for i, sock in enumerate(self.sockets):
                    if i != index:
                        sock.close()
                self.work(self.sockets[index], index)
                code = 0
            except SystemExit as exc:  # sys.exit("kvgate: ...") says why it cannot start
                code = exc.code if isinstance(exc.code, int) else FATAL
                if not isinstance(exc.code, int | None):
                    print(exc.code, file=sys.stderr)
            except BaseException:
                log.exception("worker %d failed", index)
            finally:
                logging.shutdown()
                os._exit(code)
        self.children[pid] = index

    def _stop(self, sig: int, frame: FrameType | None) -> None:
        """Once: a second SIGTERM would end a worker's drain at once."""
        if self.stopping:
            return
        log.info("%s: stopping %d workers", signal.Signals(sig).name, len(self.children))
        self.stopping = True
        if self.engine is not None:
            self.engine.stopping = True  # no restart from here on; stopped after the drain
        for pid in self.children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
