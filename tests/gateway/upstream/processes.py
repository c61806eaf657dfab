"""Real kvgate processes on loopback for the fleet tests: engine upstreams (the tiny model,
whatever is installed, a 16 MiB KV cache) and gateways in fleet mode, each startable again on the same port (or
another server run the same way: ``command``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.gateway.live_server import free_port
from tests.gateway.wire import modern_headers, modern_meta

REPO_ROOT = Path(__file__).resolve().parents[3]
# Fast health checks so a stall is seen within about a second.
FLEET_FLAGS = (
    "--upstream-health-interval",
    "0.25",
    "--upstream-health-timeout",
    "0.5",
    "--upstream-unhealthy-after",
    "2",
    "--upstream-read-timeout",
    "3",
)


class Process:
    def __init__(
        self,
        log_dir: Path,
        *flags: str,
        env: dict[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        command: tuple[str, ...] = ("-m", "kvgate", "serve"),
        model: str | None = "tiny",
    ) -> None:
        """``model``: its ``KVGATE_MODEL``; None for a gateway in fleet mode (where a model
        names the tokenizer's folder)."""
        self.host, self.port = host, port or free_port()
        self.base = f"http://{host}:{self.port}"
        self.flags, self.log_dir = flags, log_dir
        self.env = ({} if model is None else {"KVGATE_MODEL": model}) | (env or {})
        self.command = command
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        with self._log_path.open("ab") as log:  # the child keeps it
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    *self.command,
                    "--host",
                    self.host,
                    "--port",
                    str(self.port),
                    *self.flags,
                ],
                cwd=REPO_ROOT,
                env={**os.environ, "KVGATE_KV_CACHE_MEMORY": "16MiB", **self.env},
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        return self

    def wait_ready(self, timeout_s: float = 120) -> Process:
        deadline = time.monotonic() + timeout_s
        while not self.ready():
            assert self.process is not None and self.process.poll() is None, self.log()
            assert time.monotonic() < deadline, f"{self.base} did not become ready"
            time.sleep(0.1)
        return self

    def ready(self) -> bool:
        try:
            return httpx.get(self.base + "/readyz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def signal(self, sig: signal.Signals) -> None:
        assert self.process is not None
        self.process.send_signal(sig)
        if sig == signal.SIGKILL:
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.kill()
            self.process.wait()

    @property
    def _log_path(self) -> Path:
        return self.log_dir / f"kvgate-{self.host}-{self.port}.log"

    def log(self) -> str:
        return self._log_path.read_text(errors="replace")

    def readyz(self) -> dict[str, Any]:
        return httpx.get(self.base + "/readyz", timeout=2).json()

    def metrics(self) -> str:
        return httpx.get(self.base + "/metrics", timeout=2).text


@contextmanager
def peer(
    command: list[str], log_path: Path, probe: str, timeout_s: float, poll_s: float = 0.2
) -> Iterator[None]:
    """Another project's server (vLLM, sglang-router) run as ``command``, its output in
    ``log_path``: ready once ``GET probe`` answers 200, terminated afterwards."""
    with peers([(command, log_path, probe)], timeout_s, poll_s):
        yield


@contextmanager
def peers(
    servers: list[tuple[list[str], Path, str]],
    timeout_s: float,
    poll_s: float = 0.2,
    env: dict[str, str] | None = None,
) -> Iterator[None]:
    """Several such servers, each ``(command, log_path, probe)`` with ``env`` added to its
    environment, all started before any is waited for, so that their starts overlap."""
    processes = []
    try:
        for command, log_path, _ in servers:
            with log_path.open("wb") as log:
                processes.append(
                    subprocess.Popen(
                        command,
                        cwd=REPO_ROOT,
                        env={**os.environ, **(env or {})},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        deadline = time.monotonic() + timeout_s
        for process, (command, log_path, probe) in zip(processes, servers, strict=True):
            while True:
                assert process.poll() is None, (
                    f"{command[:3]} exited: {log_path.read_text()[-2000:]}"
                )
                assert time.monotonic() < deadline, f"{command[:3]} did not start"
                try:
                    if httpx.get(probe, timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(poll_s)
        yield
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def running(processes: list[Process], timeout_s: float = 120) -> Iterator[list[Process]]:
    """Start them all, wait until each is ready, and stop them all afterwards."""
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.wait_ready(timeout_s)
        yield processes
    finally:
        for process in processes:
            process.stop()


def gateway(log_dir: Path, upstreams: list[Process], *flags: str, **env: str) -> Process:
    urls = [f for u in upstreams for f in ("--upstream", u.base)]
    return Process(log_dir, *urls, *FLEET_FLAGS, *flags, env=env, model=None)


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (from /proc: every thread's children)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        found += [int(child) for child in task.read_text().split()]
    return found


def alive(pid: int) -> bool:
    """Running: not gone, and not a zombie waiting for its parent."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


def tool_call(arguments: dict[str, Any], name: str = "generate", progress: bool = False) -> dict:
    meta = modern_meta(progressToken="p") if progress else modern_meta()
    return {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": name, "arguments": arguments, "_meta": meta},
    }


def mcp_headers(arguments: dict[str, Any], name: str = "generate") -> dict[str, str]:
    """The modern headers of a tool call (``Mcp-Param-Cache-Key`` mirrors the argument)."""
    extra = {"Mcp-Param-Cache-Key": arguments["cache_key"]} if "cache_key" in arguments else {}
    return modern_headers("tools/call", name, **extra)


def call_tool(
    base: str, name: str, arguments: dict[str, Any], timeout_s: float = 30
) -> dict[str, Any]:
    """A JSON ``tools/call``: its result (tool errors included)."""
    response = httpx.post(
        base + "/mcp",
        content=orjson.dumps(tool_call(arguments, name)),
        headers=mcp_headers(arguments, name),
        timeout=timeout_s,
    )
    body = response.json()
    assert "result" in body, body
    return body["result"]


def generate(base: str, timeout_s: float = 30, **arguments: Any) -> dict[str, Any]:
    """A JSON ``tools/call`` of ``generate``: its result (tool errors included)."""
    return call_tool(base, "generate", {"max_tokens": 1, "temperature": 0, **arguments}, timeout_s)
