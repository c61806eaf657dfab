"""The Tasks extension (``io.modelcontextprotocol/tasks``, SEP-2663) as pure rules.

Negotiation is per request: a client declares the extension in its ``_meta`` client
capabilities, and only such a request may be answered with a ``CreateTaskResult``
(``resultType: "task"``); a legacy-era request never is (it has no per-request capabilities).
A non-declaring client that calls ``tasks/*`` gets −32021 naming the extension. Task ids
travel in ``params.taskId`` and are mirrored in ``Mcp-Name`` (``methods.NAME_BEARING``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from kvgate.protocol.errors import MISSING_REQUIRED_CLIENT_CAPABILITY, ProtocolError, invalid_params
from kvgate.protocol.modern import CLIENT_CAPABILITIES_KEY, SERVER_INFO_KEY

TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
TaskStatus = Literal["working", "input_required", "completed", "failed", "cancelled"]
TERMINAL: frozenset[str] = frozenset(("completed", "failed", "cancelled"))
STATUSES: frozenset[str] = TERMINAL | {"working", "input_required"}
# What a server-minted id may look like (an optional "prefix." and secrets.token_urlsafe);
# anything else is not found.
TASK_ID = re.compile(r"([A-Za-z0-9]{1,32}\.)?[A-Za-z0-9_-]{16,128}")


def iso_time(epoch_ms: int) -> str:
    """ISO 8601 in UTC, to the millisecond (``2026-12-02T01:02:03.456Z``)."""
    moment = datetime.fromtimestamp(epoch_ms / 1000, UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def declares_tasks(meta: dict[str, Any]) -> bool:
    """Whether a request's ``_meta`` client capabilities declare the extension."""
    capabilities = meta.get(CLIENT_CAPABILITIES_KEY)
    extensions = capabilities.get("extensions") if isinstance(capabilities, dict) else None
    return isinstance(extensions, dict) and isinstance(extensions.get(TASKS_EXTENSION), dict)


def missing_tasks_capability(why: str) -> ProtocolError:
    """−32021 naming the extension the request needed."""
    data: dict[str, Any] = {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}}
    return ProtocolError(
        MISSING_REQUIRED_CLIENT_CAPABILITY, f"Missing required client capability: {why}", data
    )


def check_listen_filter(notifications: Any, meta: dict[str, Any]) -> None:
    """A ``subscriptions/listen`` asking for task notifications (``taskIds``) from a client
    that does not declare the extension is −32021 (kvgate sends none: its acknowledgement
    lists no task ids, and clients poll)."""
    if isinstance(notifications, dict) and "taskIds" in notifications and not declares_tasks(meta):
        raise missing_tasks_capability("task notifications (taskIds) need the extension declared")


def task_not_found() -> ProtocolError:
    """The one answer for an id that is unknown, expired or another tenant's (no leak)."""
    return invalid_params("Failed to retrieve task: Task not found")


def task_id_of(params: dict[str, Any]) -> str:
    """``params.taskId``: a string (−32602 otherwise); an id this server cannot have minted
    is simply not found."""
    task_id = params.get("taskId")
    if not isinstance(task_id, str):
        raise invalid_params("params.taskId must be a string")
    if TASK_ID.fullmatch(task_id) is None:
        raise task_not_found()
    return task_id


@dataclass(frozen=True, slots=True)
class TaskView:
    """What the wire shows of a task (timestamps already ISO 8601)."""

    task_id: str
    status: str
    created_at: str
    last_updated_at: str
    ttl_ms: int | None
    poll_interval_ms: int
    status_message: str | None = None
    result: dict[str, Any] | None = None  # completed: the CallToolResult
    error: dict[str, Any] | None = None  # failed: the JSON-RPC error

    def task(self) -> dict[str, Any]:
        """The ``Task`` fields, with the status's own payload inlined (``DetailedTask``)."""
        body: dict[str, Any] = {
            "taskId": self.task_id,
            "status": self.status,
            "createdAt": self.created_at,
            "lastUpdatedAt": self.last_updated_at,
            "ttlMs": self.ttl_ms,
            "pollIntervalMs": self.poll_interval_ms,
        }
        if self.status_message is not None:
            body["statusMessage"] = self.status_message
        if self.status == "completed" and self.result is not None:
            body["result"] = self.result
        if self.status == "failed" and self.error is not None:
            body["error"] = self.error
        return body


def create_task_result(view: TaskView, server_info: dict[str, Any]) -> dict[str, Any]:
    """``CreateTaskResult``: the seed state, ``resultType: "task"`` (nothing else may say so)."""
    seed = view.task()
    seed.pop("result", None)
    seed.pop("error", None)
    return {"resultType": "task", **seed, "_meta": {SERVER_INFO_KEY: server_info}}


def get_task_result(view: TaskView, server_info: dict[str, Any]) -> dict[str, Any]:
    """``GetTaskResult``: the ``DetailedTask``, ``resultType: "complete"``."""
    return {"resultType": "complete", **view.task(), "_meta": {SERVER_INFO_KEY: server_info}}


def acknowledgement(server_info: dict[str, Any]) -> dict[str, Any]:
    """The empty result of ``tasks/update`` and ``tasks/cancel``."""
    return {"resultType": "complete", "_meta": {SERVER_INFO_KEY: server_info}}
