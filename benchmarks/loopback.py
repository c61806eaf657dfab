"""Loopback helpers the benchmarks share."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port free on 127.0.0.1 right now, for a server a benchmark starts."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
