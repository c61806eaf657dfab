"""Which upstreams a fleet has: the ``--upstream`` URLs, plus every address an
``--upstream-dns`` name resolves to (a Kubernetes headless Service answers with one A record
per ready pod), re-resolved every ``--upstream-refresh`` seconds.

A name that fails to resolve keeps the addresses it had: a DNS hiccup must not empty the
ring. Addresses are sorted, so every gateway sees the same set whatever order the resolver
answers in (and the ring places members by URL anyway).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

# host, port → the addresses it resolves to (``socket.getaddrinfo`` unless a test injects one)
Resolver = Callable[[str, int], list[str]]


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


@dataclass(frozen=True)
class DnsTarget:
    scheme: str
    host: str
    port: int

    @classmethod
    def parse(cls, spec: str) -> DnsTarget:
        """``HOST:PORT`` (http) or ``http[s]://HOST:PORT``; ValueError saying what is wrong."""
        raw = spec if "://" in spec else f"http://{spec}"
        try:
            parts = urlsplit(raw)
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"--upstream-dns {spec!r}: {exc}") from None
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"--upstream-dns {spec!r}: the scheme must be http or https")
        if not parts.hostname or port is None or not 0 < port < 65536:
            raise ValueError(f"--upstream-dns {spec!r}: give HOST:PORT, e.g. vllm.default:8000")
        if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
            raise ValueError(f"--upstream-dns {spec!r}: only a scheme, host and port")
        return cls(parts.scheme, parts.hostname, port)

    def urls(self, resolve: Resolver) -> list[str]:
        """Its upstreams' base URLs now (OSError when the name does not resolve)."""
        addresses = resolve(self.host, self.port)
        if not addresses:
            raise OSError(f"{self.host} resolved to no address")
        return [url_of(self.scheme, address, self.port) for address in sorted(set(addresses))]


def url_of(scheme: str, address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"{scheme}://{host}:{port}"
