"""The pool's KV-cache events: stored once written, removed once evicted, never told for a
block released unwritten, and bounded when nobody drains them."""

from __future__ import annotations

from kvgate.engine.core.block_pool import BlockPool
from kvgate.engine.core.kv_events import Cleared, KVEventLog, Removed, Stored
from tests.engine.scheduling_helpers import make_request, make_scheduler, step


def _logged(num_blocks: int) -> tuple[KVEventLog, BlockPool]:
    pool = BlockPool(num_blocks)
    pool.events = KVEventLog(16)
    return pool.events, pool


def test_a_prompt_is_stored_once_its_step_wrote_it_as_one_chained_run() -> None:
    log, pool = _logged(16)
    scheduler = make_scheduler(16, budget=64, pool=pool)
    prompt = list(range(40))
    request = make_request(prompt, max_tokens=1)
    request.cache_salt = "tenant-a"
    scheduler.add(request)
    step(scheduler)
    events = log.drain(0)
    assert events == [
        Stored(request.block_hashes[:2], None, prompt[:32], 16, None, [("tenant-a",), None])
    ]


def test_a_chunked_prompt_names_its_parent_and_eviction_is_told() -> None:
    log, pool = _logged(5)  # 4 usable blocks
    scheduler = make_scheduler(5, budget=16, pool=pool)
    first = make_request(list(range(33)), max_tokens=1)
    scheduler.add(first)
    step(scheduler)
    step(scheduler)
    stored = [e for e in log.drain(0) if isinstance(e, Stored)]
    assert [(e.block_hashes, e.parent_hash) for e in stored] == [
        ([first.block_hashes[0]], None),
        ([first.block_hashes[1]], first.block_hashes[0]),
    ]
    while not first.finished:
        step(scheduler)
    other = make_request(list(range(1000, 1064)), max_tokens=1)  # needs every block
    scheduler.add(other)
    for _ in range(8):
        step(scheduler)
    removed = [h for e in log.drain(0) if isinstance(e, Removed) for h in e.block_hashes]
    assert set(first.block_hashes[:2]) <= set(removed)


def test_a_block_released_unwritten_is_never_told() -> None:
    log, pool = _logged(8)
    block = pool.allocate(1, 0)
    assert block is not None
    pool.register([(block[0], b"h" * 32)], 0)
    log.registered(block[0], b"h" * 32, None, list(range(16)), None, None)
    pool.release(block, 0)  # its step never ended: rolled back
    assert log.drain(0) == []
    pool.check_invariants()


def test_an_undrained_log_collapses_to_cleared() -> None:
    log = KVEventLog(16, max_events=3)
    for n in range(5):
        log.uncached(n, bytes([n]) * 32, was_ready=True)
    events = log.drain(0)
    assert events[0] == Cleared() and len(events) <= 3
