"""``Tasks`` with the in-process store, without HTTP: the drain, the id prefix, the rule's
estimate, and records read back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import orjson
import pytest

from kvgate.gateway.mcp.tool_runner import Progress
from kvgate.gateway.ops.metrics import Metrics
from kvgate.gateway.settings import Settings
from kvgate.gateway.tasks.policy import RunEstimate
from kvgate.gateway.tasks.record import TaskRecord, checked_record
from kvgate.gateway.tasks.store import MemoryTaskStore
from kvgate.gateway.tasks.tasks import SHUTDOWN, Tasks


async def endless() -> AsyncGenerator[Progress | dict[str, Any]]:
    tokens = 0
    while True:
        tokens += 1
        yield Progress(tokens, "x")
        await asyncio.sleep(0.01)


async def test_a_drain_fails_the_tasks_still_running_so_none_stays_working() -> None:
    tasks = Tasks(Settings(task_id_prefix="p1"), MemoryTaskStore(), Metrics())
    await tasks.start()
    record = await tasks.begin("generate", endless(), "key:acme")
    assert record is not None and record.task_id.startswith("p1.")
    await asyncio.sleep(0.05)
    await tasks.close(drain_s=0.05)
    failed = await tasks.get(record.task_id, "key:acme")
    assert failed.status == "failed" and failed.error is not None
    assert failed.error["message"] == SHUTDOWN and failed.tokens > 0


def test_a_bad_id_prefix_is_refused_at_startup() -> None:
    with pytest.raises(ValueError, match="--task-id-prefix"):
        Tasks(Settings(task_id_prefix="no.dots"), MemoryTaskStore(), Metrics())


def test_the_estimate_follows_observed_calls_and_the_queue() -> None:
    estimate = RunEstimate()
    assert estimate.predict_s(200) == pytest.approx(10.0)  # the 20 tokens/s prior
    estimate.observe(400, 2.0)  # 200 tokens/s, 2 s per call
    assert estimate.predict_s(200) == pytest.approx(1.0)
    assert estimate.predict_s(200, waiting=4, running=2) == pytest.approx(1.0 + 4 * 2.0 / 2)


def test_a_record_survives_its_round_trip_and_junk_does_not_pass() -> None:
    record = TaskRecord("a" * 32, "key:acme", "host:1", "generate", "working", 1, 2, 60_000, 500)

    def read(raw: bytes, task_id: str) -> TaskRecord | None:
        try:
            return checked_record(orjson.loads(raw), task_id)
        except (TypeError, ValueError):  # what RecordReader.read reads as absent
            return None

    assert read(record.to_json(), record.task_id) == record
    assert read(record.to_json(), "b" * 32) is None  # stored under another id
    bad = record.to_json().replace(b'"tokens":0', b'"tokens":-1')
    assert read(bad, record.task_id) is None
    done = record.to_json().replace(b'"working"', b'"completed"')  # completed, no result
    assert read(done, record.task_id) is None
    for junk in (b"not json", b"[1, 2]", b"12", b"[null]", b'{"id": "' + b"a" * 32 + b'"}'):
        assert read(junk, record.task_id) is None
