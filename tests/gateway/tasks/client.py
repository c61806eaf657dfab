"""A raw client for the Tasks extension over Streamable HTTP: every message it gets back is
validated against the spec's schema and, for task messages, the extension's (``wire.post``)."""

from __future__ import annotations

import time
from typing import Any

import httpx

from kvgate.protocol.modern import CLIENT_CAPABILITIES_KEY
from kvgate.protocol.tasks import TASKS_EXTENSION
from tests.gateway.wire import Exchange, call

DECLARES = {CLIENT_CAPABILITIES_KEY: {"extensions": {TASKS_EXTENSION: {}}}}
TASK_HINT = {"dev.kvgate/task": True}


def bearer(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


def generate(
    http: httpx.Client,
    url: str,
    arguments: dict[str, Any],
    *,
    declared: bool = True,
    meta: dict[str, Any] | None = None,
    key: str | None = None,
) -> Exchange:
    """A ``tools/call`` of ``generate``; ``declared`` puts the extension in ``_meta``."""
    full_meta = {**(DECLARES if declared else {}), **(meta or {})}
    return call(
        http,
        url,
        "tools/call",
        {"name": "generate", "arguments": {"temperature": 0, **arguments}},
        name="generate",
        meta=full_meta,
        headers=bearer(key),
    )


def task_call(
    http: httpx.Client,
    url: str,
    method: str,
    task_id: str,
    *,
    key: str | None = None,
    declared: bool = True,
    **params: Any,
) -> Exchange:
    """``tasks/get`` / ``tasks/update`` / ``tasks/cancel`` with ``Mcp-Name: <taskId>``."""
    return call(
        http,
        url,
        method,
        {"taskId": task_id, **params},
        name=task_id,
        meta=DECLARES if declared else {},
        headers=bearer(key),
    )


def poll_until(
    http: httpx.Client,
    url: str,
    task_id: str,
    statuses: tuple[str, ...],
    *,
    key: str | None = None,
    timeout_s: float = 30,
) -> dict[str, Any]:
    """``tasks/get`` (at most every 50 ms) until the task reaches one of ``statuses``."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = task_call(http, url, "tasks/get", task_id, key=key).result
        if result["status"] in statuses:
            return result
        assert time.monotonic() < deadline, f"task still {result['status']}: {result}"
        time.sleep(0.05)
