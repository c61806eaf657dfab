"""Who may start a call now: per-client concurrency and open listen streams.

Door-neutral: a refusal is a ``Refused`` (429 for this client's own limit, 503 for capacity,
a reason for ``kvgate_rejected_requests_total{reason}`` and a ``Retry-After``); each door
words it in its own protocol. Counters hold only keys with calls in flight, so they stay as
small as the traffic itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

from kvgate.gateway.auth.identity import current as current_identity
from kvgate.gateway.calls.errors import Refused

CLIENT_RETRY_AFTER_S = 1.0
LISTEN_RETRY_AFTER_S = 5.0


def client_key(authorization: str | None, cache_key: object) -> str | None:
    """Whose call this is: the authenticated tenant when authentication is on (so neither a
    new ``cache_key`` nor another tenant's key string moves a call to another counter); with
    it off, the bearer string (hashed, never kept), else the ``cache_key``."""
    identity = current_identity()
    if identity is not None:
        return "tenant:" + identity.tenant
    auth = authorization or ""
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return "key:" + hashlib.sha256(auth[7:].strip().encode()).hexdigest()[:32]
    if isinstance(cache_key, str):
        return "cache_key:" + cache_key
    return None


class ConcurrencyLimit:
    """At most ``limit`` holders per key at once (``limit`` 0: no limit). The key None (a
    caller who cannot be told apart from others) is neither limited nor counted."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}

    def full(self, key: str | None) -> bool:
        return key is not None and self.limit > 0 and self._held.get(key, 0) >= self.limit

    @contextmanager
    def hold(self, key: str | None) -> Iterator[None]:
        """Count one holder for the block; the caller checks ``full`` first."""
        if key is None:
            yield
            return
        self._held[key] = self._held.get(key, 0) + 1
        try:
            yield
        finally:
            left = self._held[key] - 1
            if left:
                self._held[key] = left
            else:
                del self._held[key]

    def __len__(self) -> int:
        return sum(self._held.values())


def client_limited(limit: int) -> Refused:
    return Refused(
        429,
        "client_concurrency",
        f"Too many concurrent calls from this client (limit {limit})",
        CLIENT_RETRY_AFTER_S,
    )


def listen_limited(limit: int) -> Refused:
    return Refused(
        503,
        "listen_streams",
        f"Too many open subscriptions/listen streams ({limit})",
        LISTEN_RETRY_AFTER_S,
    )
