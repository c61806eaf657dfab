"""Loopback helpers the benchmarks share."""

from __future__ import annotations

import signal
import socket
import subprocess


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
