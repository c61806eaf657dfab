"""A private, killable `redis-server` for tests: its own free port and directory, no disk writes.

Import `RedisServer` and wrap it in a fixture in the test module that needs it::

    @pytest.fixture
    def redis_server(tmp_path):
        with RedisServer(tmp_path) as server:
            yield server
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.gateway.live_server import free_port

REDIS_SERVER = shutil.which("redis-server")
requires_redis_server = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server binary not installed"
)


class RedisServer:
    """One redis-server process on a fixed loopback port that survives kill/start cycles."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None

    def start(self, timeout_s: float = 5.0) -> None:
        """Start (or restart, empty) on the same port; return once it accepts connections."""
        assert REDIS_SERVER is not None
        self._process = subprocess.Popen(
            [
                REDIS_SERVER,
                "--bind",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                "--logfile",
                "redis.log",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.1) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self._process.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        """SIGKILL, like a crash: no goodbye to connected clients beyond the closed sockets."""
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=5)
            self._process = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
