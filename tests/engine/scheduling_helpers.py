"""Requests and steps without a model, for the scheduler and KV cache manager tests."""

from __future__ import annotations

import itertools

from kvgate.engine.core.block_hash import block_hashes, root_hash
from kvgate.engine.core.block_pool import BlockPool
from kvgate.engine.core.kv_cache_manager import KVCacheManager
from kvgate.engine.core.request import Request
from kvgate.engine.core.scheduler import ScheduledBatch, Scheduler
from kvgate.engine.core.serving_stats import ServingMeter
from kvgate.engine.sampling_params import SamplingParams

ROOT = root_hash("scheduler-test", "float32")
NEXT_TOKEN = 7
MAX_MODEL_LEN = 10_000
_arrivals = itertools.count()


def make_request(prompt: list[int], max_tokens: int = 4) -> Request:
    arrival = next(_arrivals)
    return Request(
        request_id=f"r{arrival}",
        prompt_token_ids=prompt,
        params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        arrival=arrival,
        hash_root=ROOT,
        block_hashes=block_hashes(prompt, ROOT),
        eos_token_ids=frozenset(),
        max_model_len=MAX_MODEL_LEN,
    )


def make_scheduler(
    num_blocks: int,
    budget: int = 64,
    max_num_seqs: int = 8,
    reserve: int = 0,
    pool: BlockPool | None = None,
    replica: int = 0,
    caching: bool = True,
) -> Scheduler:
    pool = pool or BlockPool(num_blocks)
    kv = KVCacheManager(pool, replica, 16, caching)
    return Scheduler(kv, max_num_seqs, budget, reserve, ServingMeter(MAX_MODEL_LEN))


def step(scheduler: Scheduler) -> ScheduledBatch:
    """Schedule, 'run' (every sampled token is NEXT_TOKEN) and apply one step."""
    batch = scheduler.schedule()
    scheduler.update(batch, [(NEXT_TOKEN, None)] * len(batch.sampling))
    scheduler.kv.pool.check_invariants()
    return batch


def scheduled(batch: ScheduledBatch) -> dict[str, int]:
    return {r.request_id: n for r, n in zip(batch.requests, batch.num_new_tokens, strict=True)}
