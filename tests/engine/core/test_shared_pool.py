"""Replicas stepping concurrently in their own threads over ONE block pool."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from kvgate.engine import LLM, AsyncLLM, EngineConfig, SamplingParams
from kvgate.engine.request_options import RequestOptions
from tests.engine.test_async_llm import all_blocks_released


async def test_concurrent_replicas_sharing_a_tight_pool_stay_exact_and_leak_nothing(
    tiny_model_dir: Path,
):
    rng = random.Random(0)
    system = [rng.randrange(20, 1000) for _ in range(40)]  # a shared prefix: cross-replica hits
    prompts = [
        system + [rng.randrange(20, 1000) for _ in range(rng.randrange(1, 40))] for _ in range(16)
    ]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = [
        o.token_ids
        for o in LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="2MiB").generate(
            prompts, params
        )
    ]
    # 40 usable blocks for 16 requests of up to 6 blocks: preemption and eviction under load
    engine = AsyncLLM(
        EngineConfig(
            model=str(tiny_model_dir),
            dtype="float32",
            kv_cache_memory=40 * 16 * 1024,
            replicas=2,
            max_num_batched_tokens=64,
        )
    )
    try:

        async def run(i: int) -> list[int] | None:
            stream = engine.generate(
                prompts[i], params, RequestOptions(cache_key=f"session-{i % 5}")
            )
            async for out in stream:
                if i % 4 == 3 and len(out.token_ids) >= 5:
                    await stream.aclose()  # walk away mid-stream
                    return None
            return out.token_ids

        for _ in range(2):  # the second round runs on what the first one cached
            results = await asyncio.gather(*(run(i) for i in range(len(prompts))))
            for i, tokens in enumerate(results):
                if i % 4 != 3:
                    assert tokens == expected[i]
            assert await all_blocks_released(engine)
        stats = engine.stats()
        assert stats.prefix_hits > 0
        assert all(r.prefix_queries > 0 for r in stats.per_replica)  # both replicas served
        assert sum(r.scheduler.num_preemptions for r in engine.core.replicas) > 0
        engine.core.pool.check_invariants()
    finally:
        engine.shutdown()
