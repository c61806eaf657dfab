"""Fault isolation and the step watchdog: one failing or stuck step never takes the engine."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvgate.engine import AsyncLLM, EngineConfig, EngineStepError, EngineUnavailable, SamplingParams
from kvgate.engine.request_options import RequestOptions
from tests.engine.test_async_llm import all_blocks_released

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[AsyncLLM]:
    engine = AsyncLLM(
        EngineConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            kv_cache_memory="2MiB",
            replicas=2,
            step_timeout_s=0.3,
        )
    )
    yield engine
    engine.shutdown()
    engine.core.pool.check_invariants()


def key_for(engine: AsyncLLM, replica: int) -> str:
    """A cache key whose first choice is ``replica``."""
    router = engine.core.router
    return next(
        k
        for k in map(str, range(100))
        if router.preference(b"cache_key:" + k.encode())[0] == replica
    )


async def run(engine: AsyncLLM, prompt: str, cache_key: str | None = None) -> list[int]:
    return [o async for o in engine.generate(prompt, PARAMS, RequestOptions(cache_key=cache_key))][
        -1
    ].token_ids


async def test_a_failing_step_fails_only_its_requests_and_the_replica_serves_on(
    engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch
):
    on_0, on_1 = key_for(engine, 0), key_for(engine, 1)
    expected = await run(engine, "fault isolation check", on_0)
    runner = engine.core.replicas[0].runner  # shared by both replicas
    real = runner.execute
    calls = 0

    def fail_once_on_replica_0(batch):
        nonlocal calls
        if threading.current_thread().name == "kvgate-replica-0":
            calls += 1
            if calls == 1:
                raise RuntimeError("injected fault")
        return real(batch)

    monkeypatch.setattr(runner, "execute", fail_once_on_replica_0)
    bystander = asyncio.create_task(run(engine, "a bystander on the other replica", on_1))
    with pytest.raises(EngineStepError, match="injected fault"):
        await run(engine, "this one meets the fault", on_0)
    assert len(await bystander) == PARAMS.max_tokens
    assert await all_blocks_released(engine)
    assert sum(r.num_failed_steps for r in engine.core.replicas) == 1
    assert engine.is_ready()
    assert await run(engine, "fault isolation check", on_0) == expected  # replica 0 serves on


async def test_a_stuck_step_marks_its_replica_unready_and_the_router_skips_it(
    engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch
):
    runner = engine.core.replicas[0].runner
    real = runner.execute
    release = threading.Event()

    def stuck_on_replica_0(batch):
        if threading.current_thread().name == "kvgate-replica-0":
            release.wait(10)
        return real(batch)

    monkeypatch.setattr(runner, "execute", stuck_on_replica_0)
    key = key_for(engine, 0)
    stuck = asyncio.create_task(run(engine, "a request on replica 0", cache_key=key))
    deadline = time.monotonic() + 5
    while engine.replicas_ready()[0] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert engine.replicas_ready() == [False, True] and not engine.is_ready()
    out = [o async for o in engine.generate("meanwhile", PARAMS, RequestOptions(cache_key=key))][-1]
    assert out.replica == 1  # its key prefers replica 0, which is stalled
    release.set()
    assert len(await stuck) == PARAMS.max_tokens
    assert engine.replicas_ready() == [True, True]
    assert await all_blocks_released(engine)


async def test_no_stepping_replica_refuses_at_once(engine: AsyncLLM):
    for replica in engine.core.replicas:
        replica.failed = RuntimeError("gone")
    with pytest.raises(EngineUnavailable):
        await run(engine, "nobody home")
    for replica in engine.core.replicas:
        replica.failed = None


async def test_a_replica_whose_loop_died_refuses_new_work_at_once(
    engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch
):
    """A request admitted just before its replica's step loop died used to wait forever."""
    dead = engine.core.replicas[0]

    def broken_bookkeeping():
        raise RuntimeError("scheduler fault")

    monkeypatch.setattr(dead.scheduler, "schedule", broken_bookkeeping)
    with pytest.raises(RuntimeError, match="scheduler fault"):
        await run(engine, "the request that meets the fault", key_for(engine, 0))
    assert dead.failed is not None and not dead.available
    # The race: admit picked replica 0 while it was still alive, then it died.
    monkeypatch.setattr(engine.core, "admit", lambda request: dead)
    async with asyncio.timeout(2):
        with pytest.raises(EngineUnavailable, match="replica 0 has failed"):
            await run(engine, "admitted just before the failure")
    assert not engine._collectors
    with pytest.raises(EngineUnavailable):
        dead.submit(engine.core.make_request("direct", PARAMS))
    monkeypatch.undo()
    assert await run(engine, "replica 1 serves on", key_for(engine, 1))
