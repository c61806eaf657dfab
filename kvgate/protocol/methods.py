"""The method table: what each era serves, which methods name a target, which are cacheable.

Under modern rules the methods the 2026-07-28 revision removed (``initialize``, ``ping``,
``logging/setLevel``, ``resources/subscribe``, ``resources/unsubscribe``) are simply unknown.
"""

from __future__ import annotations

from kvgate.protocol.errors import METHOD_NOT_FOUND, ProtocolError
from kvgate.protocol.versions import Era

CATALOG_METHODS = frozenset(
    {"tools/list", "resources/list", "resources/templates/list", "resources/read", "prompts/list"}
)
"""Results that depend only on the catalog; these are served from serialized bytes."""

CACHEABLE_METHODS = CATALOG_METHODS | {"server/discover"}
"""Results that carry ``ttlMs`` and ``cacheScope`` (SEP-2549)."""

SHARED_METHODS = CATALOG_METHODS | {"tools/call", "prompts/get"}
TASK_METHODS = frozenset(("tasks/get", "tasks/update", "tasks/cancel"))
"""The Tasks extension's methods (``kvgate.protocol.tasks``): modern wire only."""

MODERN_METHODS = SHARED_METHODS | {"server/discover", "subscriptions/listen"} | TASK_METHODS
LEGACY_METHODS = SHARED_METHODS | {"initialize", "ping"}

NAME_BEARING = {
    "tools/call": "name",
    "resources/read": "uri",
    "prompts/get": "name",
    **{method: "taskId" for method in TASK_METHODS},  # the extension: Mcp-Name is the task id
}
"""Methods whose ``Mcp-Name`` header mirrors a body parameter, and which parameter."""


def check_method(method: str, era: Era) -> None:
    """Raise Method not found (-32601) unless ``method`` is served in ``era``."""
    known = MODERN_METHODS if era is Era.MODERN else LEGACY_METHODS
    if method not in known:
        raise ProtocolError(
            METHOD_NOT_FOUND, f"Method not found: {method}", data={"method": method}
        )
