"""A tools/call's deadline: the server's ``--request-timeout``, which a call's ``_meta``
``dev.kvgate/timeoutMs`` may shorten (never lengthen)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvgate.protocol.errors import invalid_params

TIMEOUT_META_KEY = "dev.kvgate/timeoutMs"


def call_timeout_s(meta: Mapping[str, Any], server_timeout_s: float) -> float:
    """A call's deadline in seconds (-32602 if the ``_meta`` value is not a positive number)."""
    value = meta.get(TIMEOUT_META_KEY)
    if value is None:
        return server_timeout_s
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise invalid_params(
            f"_meta[{TIMEOUT_META_KEY!r}] must be a positive number of milliseconds"
        )
    return min(server_timeout_s, value / 1000)
