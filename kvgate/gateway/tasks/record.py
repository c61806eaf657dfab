"""One task as kvgate stores it, and its validation when read back from a shared store.

A record is written by the process running the generation (its ``owner``) and read by any
process; whatever comes back from Redis is bounded in size (``kvgate.gateway.redis_records``) and
checked field by field here (``checked_record``), so a corrupt or foreign value reads as "not
found", never as a crash or a leak.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any

import orjson

from kvgate.protocol.tasks import STATUSES, TASK_ID, TERMINAL, TaskView, iso_time

MAX_SHORT_TEXT = 1024  # tenant, owner, tool, status message


TASK_ID_PREFIX = re.compile(r"[A-Za-z0-9]{1,32}")


def new_task_id(prefix: str | None = None) -> str:
    """192 random bits, URL-safe: unguessable, and a valid Redis key part and header value;
    after ``prefix.`` when given (``--task-id-prefix``: where a balancer routes it)."""
    token = secrets.token_urlsafe(24)
    return token if prefix is None else f"{prefix}.{token}"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@dataclass(frozen=True, slots=True)
class TaskRecord:
    task_id: str
    tenant: str  # "" when the server runs without authentication
    owner: str  # the process running the generation
    tool: str
    status: str
    created_ms: int
    updated_ms: int
    ttl_ms: int
    poll_ms: int
    tokens: int = 0  # generated so far
    result: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    message: str | None = None

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL

    @property
    def expires_ms(self) -> int:
        return self.created_ms + self.ttl_ms

    def evolve(self, **changes: Any) -> TaskRecord:
        """A later state of this task (``lastUpdatedAt`` now)."""
        return replace(self, updated_ms=now_ms(), **changes)

    def view(self) -> TaskView:
        message = self.message
        if message is None and self.status == "working":
            message = f"{self.tokens} tokens generated so far"
        return TaskView(
            task_id=self.task_id,
            status=self.status,
            created_at=iso_time(self.created_ms),
            last_updated_at=iso_time(self.updated_ms),
            ttl_ms=self.ttl_ms,
            poll_interval_ms=self.poll_ms,
            status_message=message,
            result=self.result,
            error=self.error,
        )

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "id": self.task_id,
                "tenant": self.tenant,
                "owner": self.owner,
                "tool": self.tool,
                "status": self.status,
                "created": self.created_ms,
                "updated": self.updated_ms,
                "ttl": self.ttl_ms,
                "poll": self.poll_ms,
                "tokens": self.tokens,
                "result": self.result,
                "error": self.error,
                "message": self.message,
            }
        )


def checked_record(data: Any, task_id: str) -> TaskRecord:
    """The record the JSON ``data`` stored under ``task_id`` holds; ValueError or TypeError
    for anything else."""
    if not isinstance(data, dict):
        raise TypeError("not an object")
    if data.get("id") != task_id or TASK_ID.fullmatch(task_id) is None:
        raise ValueError("id does not match its key")
    if data.get("status") not in STATUSES:
        raise ValueError("unknown status")
    texts: dict[str, str] = {}
    for key in ("tenant", "owner", "tool"):
        text = data.get(key)
        if not isinstance(text, str) or len(text) > MAX_SHORT_TEXT:
            raise ValueError(f"{key} is not a short string")
        texts[key] = text
    numbers: dict[str, int] = {}
    for key in ("created", "updated", "ttl", "poll", "tokens"):
        number = data.get(key)
        if type(number) is not int or not 0 <= number < 1 << 53:
            raise ValueError(f"{key} is not a non-negative integer")
        numbers[key] = number
    result, error, message = data.get("result"), data.get("error"), data.get("message")
    if result is not None and not isinstance(result, dict):
        raise ValueError("result is not an object")
    if error is not None and not (
        isinstance(error, dict)
        and type(error.get("code")) is int
        and isinstance(error.get("message"), str)
    ):
        raise ValueError("error is not a JSON-RPC error")
    if message is not None and (not isinstance(message, str) or len(message) > MAX_SHORT_TEXT):
        raise ValueError("message is not a short string")
    if data["status"] == "completed" and result is None:
        raise ValueError("a completed task without a result")
    if data["status"] == "failed" and error is None:
        raise ValueError("a failed task without an error")
    return TaskRecord(
        task_id=task_id,
        tenant=texts["tenant"],
        owner=texts["owner"],
        tool=texts["tool"],
        status=data["status"],
        created_ms=numbers["created"],
        updated_ms=numbers["updated"],
        ttl_ms=numbers["ttl"],
        poll_ms=numbers["poll"],
        tokens=numbers["tokens"],
        result=result,
        error=error,
        message=message,
    )
