"""Who may start a call now, and until when: per-client concurrency, open listen streams,
engine capacity, call deadlines.

Every refusal is a JSON-RPC error the transport sends with 503 (capacity) or 429 (this
client's own limit) and ``Retry-After``, and is counted in
``kvgate_rejected_requests_total{reason}``. Counters hold only keys with calls in flight, so
they stay as small as the traffic itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from engine import AdmissionRefused
from protocol.errors import (
    RATE_LIMITED,
    REQUEST_TIMEOUT,
    SERVER_OVERLOADED,
    ProtocolError,
    invalid_params,
    refused,
)

CLIENT_RETRY_AFTER_S = 1.0
LISTEN_RETRY_AFTER_S = 5.0


def client_key(headers: Mapping[str, str], arguments: Any) -> str | None:
    """Whose call this is: the bearer API key (hashed, never kept), else the ``cache_key``."""
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer " and auth[7:].strip():
        return "key:" + hashlib.sha256(auth[7:].strip().encode()).hexdigest()[:32]
    if isinstance(arguments, Mapping) and isinstance(arguments.get("cache_key"), str):
        return "cache_key:" + arguments["cache_key"]
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


def client_limited(limit: int) -> ProtocolError:
    return refused(
        RATE_LIMITED,
        f"Too many concurrent calls from this client (limit {limit})",
        "client_concurrency",
        CLIENT_RETRY_AFTER_S,
    )


def listen_limited(limit: int) -> ProtocolError:
    return refused(
        SERVER_OVERLOADED,
        f"Too many open subscriptions/listen streams ({limit})",
        "listen_streams",
        LISTEN_RETRY_AFTER_S,
    )


def engine_refused(exc: AdmissionRefused) -> ProtocolError:
    return refused(SERVER_OVERLOADED, f"Server overloaded: {exc}", exc.reason, exc.retry_after_s)


TIMEOUT_META_KEY = "dev.kvgate/timeoutMs"


def call_timeout_s(meta: Mapping[str, Any], server_timeout_s: float) -> float:
    """A call's deadline in seconds: ``_meta["dev.kvgate/timeoutMs"]`` may shorten the
    server's ``request_timeout_s``, never lengthen it (-32602 if it is not a positive number)."""
    value = meta.get(TIMEOUT_META_KEY)
    if value is None:
        return server_timeout_s
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise invalid_params(
            f"_meta[{TIMEOUT_META_KEY!r}] must be a positive number of milliseconds"
        )
    return min(server_timeout_s, value / 1000)


def deadline_exceeded(timeout_s: float) -> ProtocolError:
    return ProtocolError(
        REQUEST_TIMEOUT,
        f"Request timed out after {timeout_s:g} s; the generation was cancelled",
        data={"reason": "deadline", "timeoutS": timeout_s},
    )
