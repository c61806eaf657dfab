"""Tasks in Redis (``--redis-url``): every gateway process answers for every task.

Keys (``{id}`` a ``secrets.token_urlsafe`` id, ``{tenant}`` a hash of the tenant):

- ``kvgate:task:{id}`` the record (JSON), expiring at the task's TTL from creation;
- ``kvgate:task:{id}:lease`` the owner's lease, renewed by its heartbeat, expiring after
  ``--task-lease`` when the owner dies;
- ``kvgate:task:{id}:cancel`` a cancel request (the owner's heartbeat reads it, so a pub/sub
  message lost while the owner reconnected still cancels), published on ``kvgate:tasks:cancel``
  for the fast path;
- ``kvgate:tasks:live:{tenant}`` a sorted set of the tenant's live task ids scored by lease
  expiry, for the per-tenant cap: one script drops the entries whose lease ran out, counts
  and adds the new task's, so no two creations — in one process or in several — both take
  the last place (awaiting a count, then adding, let concurrent creations each pass it).

A task belongs to the tenant in its record: ``Tasks.get`` compares it on every read, so
another tenant's id reads as an unknown one. Writes go through one script that refuses to
replace a terminal state. Records read back are bounded and typed
(``redis_records.RecordReader``) and validated (``record.checked_record``); a bad one is
"not found".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Any

from redis.exceptions import RedisError

from kvgate.gateway.redis_connection import connect, stop_tasks
from kvgate.gateway.redis_records import BOUNDED_GET, MAX_RECORD_BYTES, RecordReader, key_part
from kvgate.gateway.tasks.record import TaskRecord, checked_record, now_ms
from kvgate.gateway.tasks.store import CancelHook, StoreUnavailable
from kvgate.protocol.tasks import TASK_ID

PREFIX = "kvgate:task:"
CANCEL_CHANNEL = "kvgate:tasks:cancel"
REDIS_FAILURES = (RedisError, OSError, asyncio.TimeoutError)
RECONNECT_S = 0.5
LISTEN_POLL_S = 0.1  # below the client's socket timeout (0.25 s)
log = logging.getLogger("kvgate.tasks")

# KEYS[1] record; ARGV[1] the new record, ARGV[2] its time to live (ms), ARGV[3] the most
# bytes a record may have. A terminal record stays terminal; a record already gone (expired,
# or not one: another type, oversized) is not brought back.
SAVE_UNLESS_TERMINAL = (
    BOUNDED_GET
    + """
local raw = bounded_get(KEYS[1], tonumber(ARGV[3]))
if not raw then return 0 end
local ok, stored = pcall(cjson.decode, raw)
if ok and type(stored) == 'table' then
  local s = stored['status']
  if s == 'completed' or s == 'failed' or s == 'cancelled' then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""
)
# KEYS[1] the tenant's live set; ARGV: now (ms), the cap (0: none), the task id, its lease's
# expiry (ms), the set's time to live (ms). 1 when the task took a place, 0 at the cap.
RESERVE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local cap = tonumber(ARGV[2])
if cap > 0 and redis.call('ZCARD', KEYS[1]) >= cap then return 0 end
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
"""


def _live_key(tenant: str) -> str:
    return "kvgate:tasks:live:" + key_part(tenant)


class RedisTaskStore:
    def __init__(self, redis_url: str) -> None:
        self._redis = connect(redis_url)
        self._save = self._redis.register_script(SAVE_UNLESS_TERMINAL)
        self._reserve = self._redis.register_script(RESERVE)
        self._records = RecordReader(self._redis)
        self._listener: asyncio.Task[None] | None = None

    async def start(self, on_cancel: CancelHook) -> None:
        self._listener = asyncio.create_task(self._listen(on_cancel), name="kvgate-task-cancels")

    async def close(self) -> None:
        if self._listener is not None:
            await stop_tasks({self._listener})
        await self._redis.aclose()

    async def live(self, tenant: str) -> int:
        key = _live_key(tenant)
        async with self._failures():
            pipe = self._redis.pipeline(transaction=False)
            pipe.zremrangebyscore(key, "-inf", now_ms())
            pipe.zcard(key)
            return int((await pipe.execute())[1])

    async def create(self, record: TaskRecord, lease_s: float, cap: int) -> bool:
        """The task takes one of its tenant's places (``RESERVE``), then is stored; a place
        taken by a task whose record then could not be written is freed when its lease
        would have run out."""
        now, lease_ms = now_ms(), int(lease_s * 1000)
        places = [now, cap, record.task_id, now + lease_ms, max(record.ttl_ms, lease_ms)]
        async with self._failures():
            if not await self._reserve(keys=[_live_key(record.tenant)], args=places):
                return False
            pipe = self._redis.pipeline(transaction=True)
            pipe.set(PREFIX + record.task_id, record.to_json(), px=record.ttl_ms)
            pipe.set(PREFIX + record.task_id + ":lease", record.owner, px=lease_ms)
            await pipe.execute()
        return True

    async def get(self, task_id: str) -> TaskRecord | None:
        async with self._failures():
            return await self._records.read(
                PREFIX + task_id, lambda data: checked_record(data, task_id)
            )

    async def save(self, record: TaskRecord) -> None:
        left = record.expires_ms - now_ms()
        if left <= 0:
            return
        async with self._failures():
            record_args = [record.to_json(), left, MAX_RECORD_BYTES]
            await self._save(keys=[PREFIX + record.task_id], args=record_args)
            if record.terminal:
                pipe = self._redis.pipeline(transaction=False)
                pipe.delete(PREFIX + record.task_id + ":lease")
                pipe.zrem(_live_key(record.tenant), record.task_id)
                await pipe.execute()

    async def renew(self, records: Iterable[TaskRecord], lease_s: float) -> set[str]:
        owned = list(records)
        if not owned:
            return set()
        lease_ms = int(lease_s * 1000)
        async with self._failures():
            pipe = self._redis.pipeline(transaction=False)
            for record in owned:
                pipe.pexpire(PREFIX + record.task_id + ":lease", lease_ms)
                pipe.zadd(_live_key(record.tenant), {record.task_id: now_ms() + lease_ms})
                pipe.exists(PREFIX + record.task_id + ":cancel")
            answers = await pipe.execute()
        asked = answers[2::3]
        return {r.task_id for r, cancel in zip(owned, asked, strict=True) if cancel}

    async def lease_alive(self, task_id: str) -> bool:
        async with self._failures():
            return bool(await self._redis.exists(PREFIX + task_id + ":lease"))

    async def request_cancel(self, task_id: str) -> None:
        record = await self.get(task_id)
        left = record.expires_ms - now_ms() if record is not None else 0
        async with self._failures():
            if left > 0:
                await self._redis.set(PREFIX + task_id + ":cancel", b"1", px=left)
            await self._redis.publish(CANCEL_CHANNEL, task_id)

    @contextlib.asynccontextmanager
    async def _failures(self) -> Any:
        try:
            yield
        except REDIS_FAILURES as exc:
            raise StoreUnavailable(f"the task store (Redis) did not answer: {exc}") from exc

    async def _listen(self, on_cancel: CancelHook) -> None:
        """Cancel requests from any process, for whichever of them this process owns;
        reconnects after a failure (the heartbeat's cancel-key check covers the gap)."""
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(CANCEL_CHANNEL)
                while True:
                    message = await pubsub.get_message(
                        ignore_subscribe_messages=True, timeout=LISTEN_POLL_S
                    )
                    data = None if message is None else message.get("data")
                    if isinstance(data, bytes) and TASK_ID.fullmatch(data.decode("latin-1")):
                        on_cancel(data.decode("ascii"))
            except REDIS_FAILURES as exc:
                log.warning("task cancel channel: %s; reconnecting", exc)
            finally:
                with contextlib.suppress(*REDIS_FAILURES):
                    await pubsub.aclose()
            await asyncio.sleep(RECONNECT_S)
