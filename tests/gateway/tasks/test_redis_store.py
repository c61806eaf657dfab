"""``RedisTaskStore`` against a private redis-server: durable create, the per-tenant cap (also
under concurrent creations), a terminal state that stays terminal, leases, cancel requests by
pub/sub and by key, and records that are not tasks (another type, oversized) read as none."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvgate.gateway.tasks.record import TaskRecord, new_task_id, now_ms
from kvgate.gateway.tasks.redis_store import PREFIX, RedisTaskStore
from tests.gateway.redis_fixtures import RedisServer, requires_redis_server

pytestmark = requires_redis_server


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path) as server:
        yield server


def task(tenant: str = "key:acme") -> TaskRecord:
    now = now_ms()
    return TaskRecord(
        new_task_id(), tenant, "owner-1", "generate", "working", now, now, 60_000, 500
    )


async def test_the_store_shares_state_between_two_clients(redis_server: RedisServer) -> None:
    owner, reader = RedisTaskStore(redis_server.url), RedisTaskStore(redis_server.url)
    cancelled: list[str] = []
    await owner.start(cancelled.append)
    await reader.start(lambda task_id: None)
    try:
        first, second = task(), task()
        assert await owner.create(first, lease_s=0.3, cap=2)
        assert await owner.create(second, lease_s=0.3, cap=2)
        assert not await owner.create(task(), lease_s=0.3, cap=2)  # the tenant's cap
        assert await owner.create(task("key:globex"), lease_s=0.3, cap=2)  # another tenant's
        assert await reader.get(first.task_id) == first  # durable once create returns

        progressed = first.evolve(tokens=5)
        await owner.save(progressed)
        assert (await reader.get(first.task_id)) == progressed
        failed = first.evolve(status="failed", error={"code": -32603, "message": "x"})
        await reader.save(failed)
        await owner.save(first.evolve(status="completed", result={"content": []}))
        assert (await reader.get(first.task_id)) == failed  # terminal stays terminal
        assert await owner.create(task(), lease_s=0.3, cap=2)  # the failed one left the cap

        assert await reader.lease_alive(second.task_id)
        await reader.request_cancel(second.task_id)
        for _ in range(100):  # the pub/sub fast path reaches the owner's listener
            if cancelled:
                break
            await asyncio.sleep(0.02)
        assert cancelled == [second.task_id]
        assert await owner.renew([second], lease_s=0.3) == {second.task_id}  # and the key
        await asyncio.sleep(0.4)
        assert not await reader.lease_alive(second.task_id)  # no renewal: the lease lapses
    finally:
        await owner.close()
        await reader.close()


async def test_concurrent_creations_never_pass_the_tenants_cap(redis_server: RedisServer) -> None:
    """Each creation counted the tenant's live tasks, awaited the answer, then added its own:
    eight at once in one process all saw room under a cap of four."""
    store = RedisTaskStore(redis_server.url)
    try:
        made = await asyncio.gather(*(store.create(task(), lease_s=5, cap=4) for _ in range(8)))
        assert sum(made) == 4
        assert await store.live("key:acme") == 4
        assert await store.create(task("key:globex"), lease_s=5, cap=4)  # another tenant's
    finally:
        await store.close()


async def test_a_key_that_holds_no_task_record_reads_as_no_task(
    redis_server: RedisServer,
) -> None:
    """A hash under a task's key raised WRONGTYPE (a −32603 naming it, where an unknown id is
    "not found"), and a 24 MiB value was read up to 8 MiB; both are now no task, and a write
    over them is refused as over an expired one."""
    store = RedisTaskStore(redis_server.url)
    raw = redis.Redis.from_url(redis_server.url)
    try:
        hashed, huge = task(), task()
        raw.hset(PREFIX + hashed.task_id, mapping={"id": hashed.task_id})
        raw.set(PREFIX + huge.task_id, b"{" + b" " * (24 << 20) + b"}")
        for record in (hashed, huge):
            assert await store.get(record.task_id) is None
            await store.save(record.evolve(tokens=1))
            assert await store.get(record.task_id) is None
    finally:
        raw.close()
        await store.close()
