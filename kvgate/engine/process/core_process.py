"""The engine core in a process of its own, serving API processes over a Unix socket.

``python -m kvgate.engine.process.core_process SOCKET CONFIG PARENT PHASES`` loads the model (``EngineCore``, its
replicas stepping in their threads with every usable core: no event loop shares this process),
then listens on ``SOCKET``; its appearance is the sign that the engine is ready. Until then it
writes each step of its start as it begins to the pipe PHASES (a file descriptor it inherited),
one ``name<TAB>what it does`` line each, for the parent to show (``kvgate.gateway.engine_supervisor``). Each API process
holds one connection (``kvgate.engine.process.core_client.EngineClient``) and sends frames (``kvgate.engine.process.ipc``):

    ("submit", tag, token_ids, params, cache_key, cache_salt, lora_name)
    ("embed", tag, token_ids, cache_key, cache_salt)
    ("abort", tag, reason)               # reason: "abort", or "stop" (a stop string)
    ("call", tag, method, args)          # compile_grammar, add_lora, remove_lora, state

and receives lists of messages: ``("ok", tag, value)`` / ``("err", tag, exception)`` answer a
submit (admitted: the replica; or refused) or a call; ``("out", tag, StepOutput)`` and
``("fail", tag, exception)`` are a request's news; ``("state", State)`` the engine's stats,
replicas and adapters, sent every ``STATE_INTERVAL_S`` and after any adapter change. A
step's news for every request of a connection travels as one frame, sent by the step thread
at the step's end (``Replica.on_step_end``) when the socket takes it at once, else queued
for the connection's writer thread: a slow API process never holds up a step.

A connection that closes (its API process died) has its requests aborted; the engine and
the other connections go on. SIGTERM stops the replicas and exits 0.

The adapters served are written beside the socket (``ADAPTERS_FILE``) after every change, and
an engine started again by its supervisor loads that list rather than ``--lora-modules``: a
restart does not lose the adapters loaded (or removed) at run time.
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kvgate.engine.process.ipc as ipc
from kvgate.engine.config import EngineConfig
from kvgate.engine.core.engine_core import EngineCore, PhaseSink
from kvgate.engine.core.replica import Replica
from kvgate.engine.core.request import Request
from kvgate.engine.core.stat_logger import started
from kvgate.engine.errors import EngineStepError
from kvgate.engine.memory import freeze_long_lived
from kvgate.engine.outputs import StepOutput
from kvgate.engine.process.ipc import Adapter, Hello, State
from kvgate.engine.process.kv_publisher import start_publisher
from kvgate.engine.process.logs import configure_logging

log = logging.getLogger("kvgate.engine")
STATE_INTERVAL_S = 0.25
CALL_WORKERS = 4  # grammar compiles and adapter loads run beside each other, off the readers
# The GIL handoff between the step threads and the connection threads (as serving sets it).
SWITCH_INTERVAL_S = 0.0002
PR_SET_PDEATHSIG = 1
FATAL = 2  # the model (or a --lora-modules adapter) cannot be loaded: no use trying again
ADAPTERS_FILE = "adapters.pickle"


class Connection:
    """One API process: a reader thread handling its frames, a writer thread batching ours."""

    def __init__(self, server: EngineServer, sock: socket.socket) -> None:
        self.server, self.sock = server, sock
        self.requests: dict[int, tuple[Request, Replica]] = {}  # tag → running request
        self.pending: list[Any] = []  # this step's news (under the server's lock)
        self._backlog = bytearray()  # what the socket would not take at once
        self._writing = False
        self._cond = threading.Condition()
        self._closed = False

    def start(self) -> None:
        threading.Thread(target=self._read, name="kvgate-engine-read", daemon=True).start()
        threading.Thread(target=self._write, name="kvgate-engine-write", daemon=True).start()

    def post(self, messages: list[Any]) -> None:
        """Send ``messages`` as one frame, from the calling thread when the socket takes it
        at once (a step thread never waits on an API process); what it does not take, and
        all that follows it, the writer thread sends in order."""
        data = ipc.encode(messages)
        with self._cond:
            if self._closed:
                return
            if self._backlog or self._writing:
                self._backlog += data
                self._cond.notify()
                return
            try:
                sent = self.sock.send(data, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError:
                sent = len(data)  # the reader sees the connection end and closes it
            if sent < len(data):
                self._backlog += data[sent:]
                self._cond.notify()

    def _write(self) -> None:
        while True:
            with self._cond:
                while not self._backlog and not self._closed:
                    self._writing = False
                    self._cond.wait()
                if self._closed:
                    return
                data, self._backlog = bytes(self._backlog), bytearray()
                self._writing = True
            try:
                self.sock.sendall(data)
            except OSError:
                self._close()
                return

    def _read(self) -> None:
        try:
            while True:
                self._handle(ipc.receive(self.sock))
        except (EOFError, OSError):
            pass
        except Exception:  # a frame this engine cannot read: drop the connection, not the engine
            log.exception("engine: a connection sent what it cannot read")
        self._close()

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind, tag = message[0], message[1]
        server = self.server
        if kind == "submit":
            _, _, prompt, params, cache_key, cache_salt, lora_name = message
            self._admit(
                tag,
                lambda: server.core.make_request(prompt, params, cache_key, cache_salt, lora_name),
            )
        elif kind == "embed":
            _, _, prompt, cache_key, cache_salt = message
            self._admit(
                tag, lambda: server.core.make_embedding_request(prompt, cache_key, cache_salt)
            )
        elif kind == "abort":
            reason = message[2]
            with server.lock:
                running = self.requests.pop(tag, None)
                if running is not None:
                    server.owners.pop(running[0].request_id, None)
            if running is not None:
                running[1].abort(running[0], reason)
        elif kind == "call":
            server.calls.submit(self._call, tag, message[2], message[3])
        else:
            raise ValueError(f"unknown message {kind!r}")

    def _admit(self, tag: int, make: Any) -> None:
        server = self.server
        try:
            request = make()
            replica = server.core.admit(request)
            with server.lock:
                server.owners[request.request_id] = (self, tag)
                self.requests[tag] = (request, replica)
            try:
                replica.submit(request)
            except BaseException:
                with server.lock:
                    server.owners.pop(request.request_id, None)
                    self.requests.pop(tag, None)
                raise
        except Exception as exc:  # refused or bad input: the caller raises it
            self.post([("err", tag, exc)])
            return
        self.post([("ok", tag, replica.index)])

    def _call(self, tag: int, method: str, args: tuple[Any, ...]) -> None:
        try:
            value = self.server.call(method, args)
        except Exception as exc:
            self.post([("err", tag, exc)])
            return
        self.post([("ok", tag, value)])

    def _close(self) -> None:
        """The API process is gone: abort its requests (their blocks go back to the pool)."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify()
        server = self.server
        with server.lock:
            running = list(self.requests.values())
            self.requests.clear()
            for request, _ in running:
                server.owners.pop(request.request_id, None)
            server.connections.discard(self)
        for request, replica in running:
            replica.abort(request)
        try:
            self.sock.close()
        except OSError:
            pass


class EngineServer:
    def __init__(
        self, config: EngineConfig, adapters_path: Path, on_phase: PhaseSink | None = None
    ) -> None:
        """``adapters_path``: where the adapters served are kept for a restarted engine;
        ``on_phase``: see ``EngineCore``."""
        self.adapters_path = adapters_path
        self.lock = threading.Lock()
        self.owners: dict[str, tuple[Connection, int]] = {}  # request id → (connection, tag)
        self.connections: set[Connection] = set()
        self._dirty: list[Connection] = []  # connections with news this step
        self.core = EngineCore(config, on_output=self._deliver, on_phase=on_phase)
        self.kv_events = start_publisher(config.kv_events_config, self.core.pool)
        for replica in self.core.replicas:
            replica.on_step_end = self._flush
        self.calls = ThreadPoolExecutor(CALL_WORKERS, thread_name_prefix="kvgate-engine-call")
        for replica in self.core.replicas:
            replica.start()
        started(self.core.stats, config.stats_interval_s)  # a daemon thread: ends with the process

    def hello(self) -> Hello:
        core = self.core
        return Hello(
            core.model_name,
            core.limits,
            core.tokenizer,
            dict(core.model_config.generation_defaults),
            core.grammars.max_spec_bytes,
            os.getpid(),
        )

    def state(self) -> State:
        return State(
            self.core.stats(),
            [r.available for r in self.core.replicas],
            [Adapter(a.name, str(a.path)) for a in self.core.loras.list()],
        )

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        core = self.core
        if method == "hello":
            return self.hello()
        if method == "state":
            return self.state()
        if method == "compile_grammar":
            core.grammars.compile(args[0])
            return None
        if method == "add_lora":
            core.add_lora(*args)
            self.adapters_changed()
            return None
        if method == "remove_lora":
            removed = core.remove_lora(*args)
            self.adapters_changed()
            return removed
        raise ValueError(f"unknown engine call {method!r}")

    def adapters_changed(self) -> None:
        """Keep the list for a restart (written whole, then renamed), and tell every API
        process."""
        adapters = [(a.name, str(a.path)) for a in self.core.loras.list()]
        temporary = self.adapters_path.with_suffix(".tmp")
        temporary.write_bytes(pickle.dumps(adapters))
        temporary.replace(self.adapters_path)
        self.broadcast_state()

    def load_adapters(self, configured: list[tuple[str, str]]) -> None:
        """At start: the adapters a previous engine served, if it served any; else
        ``configured`` (``--lora-modules``). One of the former that no longer loads (its
        files gone) is logged and left out; one of the latter is fatal."""
        if self.adapters_path.exists():
            kept: list[tuple[str, str]] = pickle.loads(self.adapters_path.read_bytes())
            for name, adapter_path in kept:
                try:
                    self.core.add_lora(name, adapter_path)
                except ValueError as exc:
                    log.error(
                        "LoRA adapter %s from %s not loaded again: %s", name, adapter_path, exc
                    )
            self.adapters_changed()
            return
        for name, adapter_path in configured:
            try:
                self.core.add_lora(name, adapter_path)
            except ValueError as exc:
                print(f"kvgate: --lora-modules: {exc}", file=sys.stderr)
                sys.exit(FATAL)
            log.info("LoRA adapter %s from %s", name, adapter_path)

    def broadcast_state(self) -> None:
        message = ("state", None, self.state())
        with self.lock:
            connections = list(self.connections)
        for connection in connections:
            connection.post([message])

    def _deliver(self, request: Request, item: StepOutput | BaseException) -> None:
        """A replica's step thread: route a request's news to the connection that sent it."""
        with self.lock:
            owner = self.owners.get(request.request_id)
            if owner is not None and (isinstance(item, BaseException) or item.finished):
                del self.owners[request.request_id]
                owner[0].requests.pop(owner[1], None)
        if owner is None:
            return
        connection, tag = owner
        if isinstance(item, BaseException):
            error = EngineStepError(f"engine replica {request.replica}: {item}")
            message: tuple[Any, ...] = ("fail", tag, error)
        else:
            message = ("out", tag, item)
        with self.lock:
            if not connection.pending:
                self._dirty.append(connection)
            connection.pending.append(message)

    def _flush(self) -> None:
        """A replica's step thread, at the end of a step: one frame per connection."""
        with self.lock:
            dirty, self._dirty = self._dirty, []
            batches = [(c, c.pending) for c in dirty]
            for connection in dirty:
                connection.pending = []
        for connection, batch in batches:
            connection.post(batch)

    def serve(self, path: str) -> None:
        """Accept API processes on ``path`` until the process is stopped."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        temporary = f"{path}.{os.getpid()}"
        listener.bind(temporary)
        listener.listen(64)
        os.replace(temporary, path)  # the socket appears only once it accepts
        log.info("engine process %d serving on %s", os.getpid(), path)
        threading.Thread(target=self._tick, name="kvgate-engine-state", daemon=True).start()
        while True:
            sock, _ = listener.accept()
            connection = Connection(self, sock)
            with self.lock:
                self.connections.add(connection)
            connection.post([("ok", 0, self.hello()), ("state", None, self.state())])
            connection.start()

    def _tick(self) -> None:
        stop = threading.Event()
        while not stop.wait(STATE_INTERVAL_S):
            self.broadcast_state()

    def shutdown(self) -> None:
        for replica in self.core.replicas:
            replica.stop()


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies (Linux), so a parent killed with SIGKILL
    leaves no engine behind; exit now if the parent is already gone."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(0)


def phase_writer(fd: int) -> PhaseSink:
    """Write each phase to the pipe ``fd`` as a line; a parent that stopped reading (the
    engine started again by its watcher, nobody showing its start) costs nothing."""

    def write(name: str, what: str) -> None:
        try:
            os.write(fd, f"{name}\t{what}\n".encode())
        except OSError:
            pass

    return write


def main(argv: list[str]) -> None:
    """``SOCKET CONFIG PARENT PHASES``: CONFIG is a pickled ``(EngineConfig, [(name, path),
    ...], log format)`` (the adapters to load; "text" or "json") the parent (pid PARENT) wrote
    in a folder only this user reads; PHASES the pipe the start's steps are written to."""
    path, config_path, parent, phases = argv
    die_with_parent(int(parent))
    config, adapters, log_format = pickle.loads(Path(config_path).read_bytes())
    assert isinstance(config, EngineConfig)
    configure_logging(log_format)  # as the API processes write theirs
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # nothing to drain: API processes do
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C: the parent decides
    try:
        on_phase = phase_writer(int(phases))
        server = EngineServer(config, Path(path).with_name(ADAPTERS_FILE), on_phase)
    except (OSError, ValueError) as exc:
        print(f"kvgate: cannot load the model: {exc}", file=sys.stderr)  # as in-process says it
        sys.exit(FATAL)
    server.load_adapters(adapters)
    freeze_long_lived()
    os.close(int(phases))  # the parent reads the end of the start here
    server.serve(path)


if __name__ == "__main__":
    main(sys.argv[1:])
