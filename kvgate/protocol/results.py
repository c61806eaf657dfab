"""Result shaping: every result says it is complete and who answered; cacheable ones say for
how long and for whom (SEP-2549)."""

from __future__ import annotations

from typing import Any, Literal

from kvgate.protocol.modern import SERVER_INFO_KEY

CacheScope = Literal["public", "private"]


def complete(result: dict[str, Any], server_info: dict[str, Any]) -> dict[str, Any]:
    """``result`` with ``resultType: "complete"`` and the server's identity in ``_meta``."""
    meta = dict(result.get("_meta") or {})
    meta[SERVER_INFO_KEY] = server_info
    return {"resultType": "complete", **result, "_meta": meta}


def cacheable(
    result: dict[str, Any], server_info: dict[str, Any], ttl_ms: int, scope: CacheScope
) -> dict[str, Any]:
    """A complete result with caching hints; ``ttl_ms`` must be >= 0."""
    if ttl_ms < 0:
        raise ValueError(f"ttlMs must be >= 0, got {ttl_ms}")
    return {**complete(result, server_info), "ttlMs": ttl_ms, "cacheScope": scope}
