"""``Tasks``: this process's side of the Tasks extension — making tasks, running their
generations, and answering ``tasks/*`` for tasks any process made.

A task's generation runs in an asyncio task this object owns, not in the HTTP request that
created it: the ``tools/call`` connection may close and the generation goes on. One heartbeat
per process, every ``min(poll interval, lease / 3)``, renews the leases of the tasks it runs,
writes their progress (tokens so far: throttled, never per token) and picks up cancel requests
(``tasks/cancel`` on another process). Cancelling closes the generation's stream: the engine
aborts it at its next step and frees its KV blocks (a fleet closes the upstream connection).

On shutdown (SIGTERM drain) running tasks get ``--drain-timeout`` to finish; those still
running then are cancelled and recorded as ``failed`` (−32603, the gateway stopped), so no task
is left ``working``; a gateway killed outright is detected by its lapsed lease instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from kvgate.engine.stats import EngineStats
from kvgate.gateway.calls.errors import CallError, DeadlineExceeded, Refused
from kvgate.gateway.mcp.errors import protocol_error
from kvgate.gateway.mcp.tool_runner import DEFAULT_MAX_TOKENS, Items, Progress
from kvgate.gateway.ops.metrics import Metrics
from kvgate.gateway.settings import Settings
from kvgate.gateway.tasks.policy import TASK_TOOLS, RunEstimate, hint, predicted_tokens
from kvgate.gateway.tasks.record import TASK_ID_PREFIX, TaskRecord, new_task_id, now_ms
from kvgate.gateway.tasks.store import StoreUnavailable, TaskStore
from kvgate.protocol.errors import INTERNAL_ERROR, ProtocolError
from kvgate.protocol.tasks import missing_tasks_capability, task_not_found

log = logging.getLogger("kvgate.tasks")
OWNER_GONE = "The gateway running this task stopped before the generation finished; call again"
SHUTDOWN = "The gateway shut down before the generation finished; call again"


@dataclass
class _Running:
    record: TaskRecord
    job: asyncio.Task[None] | None = None
    written_tokens: int = 0
    cancel_asked: bool = False


class Tasks:
    def __init__(
        self,
        settings: Settings,
        store: TaskStore,
        metrics: Metrics,
        engine_stats: Callable[[], EngineStats] | None = None,
    ) -> None:
        prefix = settings.task_id_prefix
        if prefix is not None and TASK_ID_PREFIX.fullmatch(prefix) is None:
            raise ValueError(f"--task-id-prefix {prefix!r}: expected 1-32 letters or digits")
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self.engine_stats = engine_stats
        self.estimate = RunEstimate()
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.running: dict[str, _Running] = {}
        self._heartbeat: asyncio.Task[None] | None = None
        metrics.gauge(
            "kvgate_tasks_running",
            "Task generations this process is running (status working).",
            lambda: float(len(self.running)),
        )

    async def start(self) -> None:
        await self.store.start(self._cancel_local)
        self._heartbeat = asyncio.create_task(self._beat(), name="kvgate-task-heartbeat")

    async def close(self, drain_s: float) -> None:
        """Running generations get ``drain_s`` to finish, then are failed (see the module)."""
        jobs = [r.job for r in self.running.values() if r.job is not None]
        if jobs:
            log.info("draining: %d task(s) running get %.0f s", len(jobs), drain_s)
            await asyncio.wait(jobs, timeout=drain_s)
        for running in list(self.running.values()):
            if running.job is not None:
                running.job.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await running.job
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        await self.store.close()

    def wanted(self, tool: str, arguments: Any, meta: Mapping[str, Any], declared: bool) -> bool:
        """Whether this call becomes a task (the rule: ``policy``). A caller that asks for a
        task (``dev.kvgate/task: true``) without declaring the extension gets −32021."""
        asked = hint(meta)
        if asked and not declared:
            raise missing_tasks_capability(
                "a task was asked for (_meta dev.kvgate/task) but the request does not "
                "declare the io.modelcontextprotocol/tasks extension"
            )
        if not declared or tool not in TASK_TOOLS or asked is False:
            return False
        if asked:
            return True
        tokens = predicted_tokens(
            arguments if isinstance(arguments, dict) else {}, DEFAULT_MAX_TOKENS
        )
        stats = self.engine_stats() if self.engine_stats is not None else None
        waiting = stats.num_waiting if stats is not None else 0
        running = stats.num_running if stats is not None else 0
        return self.estimate.predict_s(tokens, waiting, running) > self.settings.task_threshold_s

    async def admit(self, tenant: str) -> None:
        """Before a task's generation starts: ``Refused`` (429) at the tenant's cap of live
        tasks. (Two calls racing past it are answered directly: ``begin`` gives None.)"""
        cap = self.settings.max_tasks_per_tenant
        try:
            full = bool(cap) and await self.store.live(tenant) >= cap
        except StoreUnavailable:
            return  # no task will be made: ``begin`` answers None
        if full:
            raise Refused(
                429,
                "task_limit",
                f"Too many live tasks: this tenant already has {cap} working (the "
                "--max-tasks-per-tenant limit); wait for one to finish or cancel one",
                self.settings.task_poll_interval_s,
            )

    async def begin(self, tool: str, items: Items, tenant: str) -> TaskRecord | None:
        """Make a task of a started call and run it in the background; the record once a
        ``tasks/get`` would find it. None when no task could be stored (Redis down, or the
        tenant's cap reached since ``admit``): the caller answers the call directly."""
        now = now_ms()
        record = TaskRecord(
            task_id=new_task_id(self.settings.task_id_prefix),
            tenant=tenant,
            owner=self.owner,
            tool=tool,
            status="working",
            created_ms=now,
            updated_ms=now,
            ttl_ms=int(self.settings.task_ttl_s * 1000),
            poll_ms=int(self.settings.task_poll_interval_s * 1000),
        )
        cap = self.settings.max_tasks_per_tenant
        try:
            if not await self.store.create(record, self.settings.task_lease_s, cap):
                return None
        except StoreUnavailable as exc:
            log.warning("no task made, answering directly: %s", exc)
            return None
        running = self.running[record.task_id] = _Running(record)
        running.job = asyncio.create_task(self._run(running, items), name="kvgate-task")
        self.metrics.count("kvgate_tasks", state="created")
        return record

    async def get(self, task_id: str, tenant: str) -> TaskRecord:
        """The task as the caller may see it: another tenant's, expired or unknown are all
        not found; a ``working`` task whose owner's lease lapsed is ``failed`` from now on."""
        record = await self._stored(task_id)
        if record is None or record.tenant != tenant:
            raise task_not_found()
        if record.status == "working" and not await self._owner_alive(record):
            failed = record.evolve(
                status="failed",
                error={"code": INTERNAL_ERROR, "message": OWNER_GONE},
                message=OWNER_GONE,
            )
            await self._write(failed)
            self.metrics.count("kvgate_tasks", state="failed")
            record = await self._stored(task_id) or failed
        return record

    async def cancel(self, task_id: str, tenant: str) -> None:
        """Ask the owner to stop (eventually consistent: the extension's acknowledgement)."""
        record = await self.get(task_id, tenant)
        if record.terminal:
            return
        if task_id in self.running:
            self._cancel_local(task_id)
            return
        try:
            await self.store.request_cancel(task_id)
        except StoreUnavailable as exc:
            raise ProtocolError(INTERNAL_ERROR, f"Task not cancelled: {exc}") from None

    async def _stored(self, task_id: str) -> TaskRecord | None:
        try:
            return await self.store.get(task_id)
        except StoreUnavailable as exc:
            raise ProtocolError(INTERNAL_ERROR, f"Task state unavailable: {exc}") from None

    async def _owner_alive(self, record: TaskRecord) -> bool:
        if record.owner == self.owner:
            return record.task_id in self.running
        try:
            return await self.store.lease_alive(record.task_id)
        except StoreUnavailable:
            return True  # unknown is not dead

    def _cancel_local(self, task_id: str) -> None:
        running = self.running.get(task_id)
        if running is not None and running.job is not None and not running.cancel_asked:
            running.cancel_asked = True
            running.job.cancel()

    async def _run(self, running: _Running, items: Items) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        record, result = running.record, None
        try:
            async with asyncio.timeout(self.settings.task_ttl_s), aclosing(items):
                async for item in items:
                    if isinstance(item, Progress):
                        running.record = running.record.evolve(tokens=item.tokens)
                    else:
                        result = item
            final = self._completed(record, result)
        except asyncio.CancelledError:
            final = self._ended(running)
        except TimeoutError:
            final = self._failed(record, protocol_error(DeadlineExceeded(self.settings.task_ttl_s)))
        except CallError as exc:
            final = self._failed(record, protocol_error(exc))
        except Exception:
            log.exception("task %s: generation failed", record.task_id)
            final = self._failed(record, ProtocolError(INTERNAL_ERROR, "Internal error"))
        seconds = loop.time() - started
        await self._write(final)
        self.running.pop(record.task_id, None)
        self.metrics.count("kvgate_tasks", state=final.status)
        self.metrics.task_finished(final.status, seconds)

    def _completed(self, record: TaskRecord, result: dict[str, Any] | None) -> TaskRecord:
        if result is None:
            return self._failed(record, ProtocolError(INTERNAL_ERROR, "The call had no result"))
        tokens = (result.get("structuredContent") or {}).get("completion_tokens", 0)
        done = "a tool error" if result.get("isError") else f"{tokens} tokens"
        return record.evolve(status="completed", result=result, message=f"Completed: {done}")

    def _ended(self, running: _Running) -> TaskRecord:
        if running.cancel_asked:
            return running.record.evolve(status="cancelled", message="Cancelled by the client")
        return self._failed(running.record, ProtocolError(INTERNAL_ERROR, SHUTDOWN))

    @staticmethod
    def _failed(record: TaskRecord, error: ProtocolError) -> TaskRecord:
        return record.evolve(status="failed", error=error.to_error(), message=error.message)

    async def _write(self, record: TaskRecord) -> None:
        try:
            await self.store.save(record)
        except StoreUnavailable as exc:  # a reader will see the lease lapse: failed, not lost
            log.warning("task %s: state %s not written: %s", record.task_id, record.status, exc)

    async def _beat(self) -> None:
        settings = self.settings
        period = min(settings.task_poll_interval_s, settings.task_lease_s / 3)
        while True:
            await asyncio.sleep(period)
            owned = [r for r in self.running.values() if r.job is not None]
            try:
                asked = await self.store.renew([r.record for r in owned], settings.task_lease_s)
                for running in owned:
                    if running.record.tokens != running.written_tokens:
                        running.written_tokens = running.record.tokens
                        await self.store.save(running.record)
            except StoreUnavailable as exc:
                log.warning("task heartbeat: %s", exc)
                continue
            for task_id in asked:
                self._cancel_local(task_id)
