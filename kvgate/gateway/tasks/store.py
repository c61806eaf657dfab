"""Where tasks live: the interface, and the in-process store (the default).

The owner (the process running a generation) writes a task; any process reads it. A write
never replaces a terminal state, so an owner finishing late cannot resurrect a task a reader
already marked ``failed``. Leases say the owner is alive: the owner renews them; a reader
that finds a ``working`` task whose lease ran out marks it ``failed``. A task is deleted once
its TTL (from creation) has passed. Cancellation reaches the owner through ``on_cancel``.

In-process, only this process can answer for its tasks: behind a load balancer, hash on
``Mcp-Name`` for ``tasks/*`` (the task id) or use ``--redis-url`` (``redis_store``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Protocol

from kvgate.gateway.tasks.record import TaskRecord, now_ms

CancelHook = Callable[[str], None]


class StoreUnavailable(Exception):
    """The shared store did not answer (Redis down): callers fall back or say so."""


class TaskStore(Protocol):
    async def start(self, on_cancel: CancelHook) -> None:
        """Begin delivering cancellations of tasks to ``on_cancel`` (ids of any task)."""

    async def close(self) -> None: ...

    async def create(self, record: TaskRecord, lease_s: float, cap: int) -> bool:
        """Store a new task durably (a ``get`` resolves once this returns); False when its
        tenant already has ``cap`` live tasks (0 = no cap)."""

    async def get(self, task_id: str) -> TaskRecord | None: ...

    async def live(self, tenant: str) -> int:
        """How many of ``tenant``'s tasks are working (their owner alive)."""

    async def save(self, record: TaskRecord) -> None:
        """Write a later state (ignored once the stored one is terminal)."""

    async def renew(self, records: Iterable[TaskRecord], lease_s: float) -> set[str]:
        """Extend the owner's leases on ``records``; returns the ids asked to cancel."""

    async def lease_alive(self, task_id: str) -> bool: ...

    async def request_cancel(self, task_id: str) -> None: ...


class MemoryTaskStore:
    """A dict and a sweep: tasks, leases and cancel requests of this process alone."""

    def __init__(self) -> None:
        self._tasks: dict[str, TaskRecord] = {}
        self._leases: dict[str, float] = {}  # monotonic expiry
        self._cancelled: set[str] = set()
        self._on_cancel: CancelHook | None = None

    async def start(self, on_cancel: CancelHook) -> None:
        self._on_cancel = on_cancel

    async def close(self) -> None:
        self._on_cancel = None

    async def create(self, record: TaskRecord, lease_s: float, cap: int) -> bool:
        self._sweep()
        if cap and self._live(record.tenant) >= cap:
            return False
        self._tasks[record.task_id] = record
        self._leases[record.task_id] = time.monotonic() + lease_s
        return True

    async def get(self, task_id: str) -> TaskRecord | None:
        self._sweep()
        return self._tasks.get(task_id)

    async def live(self, tenant: str) -> int:
        self._sweep()
        return self._live(tenant)

    async def save(self, record: TaskRecord) -> None:
        stored = self._tasks.get(record.task_id)
        if stored is not None and not stored.terminal:
            self._tasks[record.task_id] = record
        if record.terminal:
            self._leases.pop(record.task_id, None)

    async def renew(self, records: Iterable[TaskRecord], lease_s: float) -> set[str]:
        expiry = time.monotonic() + lease_s
        ids = {record.task_id for record in records}
        for task_id in ids:
            if task_id in self._leases:
                self._leases[task_id] = expiry
        return ids & self._cancelled

    async def lease_alive(self, task_id: str) -> bool:
        return self._leases.get(task_id, 0.0) > time.monotonic()

    async def request_cancel(self, task_id: str) -> None:
        self._cancelled.add(task_id)
        if self._on_cancel is not None:
            self._on_cancel(task_id)

    def _live(self, tenant: str) -> int:
        return sum(1 for r in self._tasks.values() if r.tenant == tenant and not r.terminal)

    def _sweep(self) -> None:
        """Delete tasks past their TTL (the extension allows discarding them then)."""
        now = now_ms()
        for task_id in [t for t, r in self._tasks.items() if r.expires_ms <= now]:
            del self._tasks[task_id]
            self._leases.pop(task_id, None)
            self._cancelled.discard(task_id)
