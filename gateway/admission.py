"""Who may start a call now: per-client concurrency, open listen streams, engine capacity.

Front-door neutral: a refusal is a ``Refusal`` (HTTP status 429 for this client's own limit,
503 for capacity, a reason for ``kvgate_rejected_requests_total{reason}`` and a
``Retry-After``); each front door words it in its own protocol. Counters hold only keys with
calls in flight, so they stay as small as the traffic itself.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from contextlib import contextmanager

from engine import AdmissionRefused
from gateway.auth.identity import current as current_identity

CLIENT_RETRY_AFTER_S = 1.0
LISTEN_RETRY_AFTER_S = 5.0


class Refusal(Exception):
    """A call refused before it started; nothing was queued."""

    def __init__(self, status: int, reason: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.status = status  # 429: this client's own limit; 503: the server's capacity
        self.reason = reason
        self.retry_after_s = max(1, math.ceil(retry_after_s))  # whole seconds, as HTTP says


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


def client_limited(limit: int) -> Refusal:
    return Refusal(
        429,
        "client_concurrency",
        f"Too many concurrent calls from this client (limit {limit})",
        CLIENT_RETRY_AFTER_S,
    )


def listen_limited(limit: int) -> Refusal:
    return Refusal(
        503,
        "listen_streams",
        f"Too many open subscriptions/listen streams ({limit})",
        LISTEN_RETRY_AFTER_S,
    )


def engine_refused(exc: AdmissionRefused) -> Refusal:
    return Refusal(503, exc.reason, f"Server overloaded: {exc}", exc.retry_after_s)
