"""Loopback helpers the benchmarks share."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import httpx


def free_port() -> int:
    """A port free on 127.0.0.1 right now, for a server a benchmark starts."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop(process: subprocess.Popen[bytes] | subprocess.Popen[str], timeout_s: float) -> None:
    """Stop a server the benchmark started as Ctrl-C would (its own shutdown runs), killing it
    if it has not exited within ``timeout_s``."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def wait_ready(
    process: subprocess.Popen[bytes] | subprocess.Popen[str],
    url: str,
    timeout_s: float,
    poll_s: float,
) -> None:
    """Poll ``url`` until it answers 200; fail if the server exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert process.poll() is None and time.monotonic() < deadline, url
        time.sleep(poll_s)
