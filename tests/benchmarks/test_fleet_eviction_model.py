"""The eviction model: LRU caches that keep a request's prefix longest; with room, the hash and
the pooled cache compute the floor and precise pays copies of shared prompts for balance; small
caches compute more."""

from __future__ import annotations

from benchmarks.fleet_eviction import trace
from benchmarks.fleet_eviction_model import (
    BLOCK,
    LruCache,
    PreciseRouter,
    agents,
    hash_router,
    packed_router,
    replay,
)
from kvgate.gateway.upstream.kv_index import request_keys
from tests.benchmarks.test_fleet_eviction import options


def test_a_request_is_evicted_tail_first() -> None:
    cache = LruCache(3)
    keys = request_keys(list(range(3 * BLOCK)), BLOCK, None, None)
    assert cache.serve(keys, 0.0) == 0
    other = request_keys([7] * BLOCK, BLOCK, None, None)
    assert cache.serve(other, 0.1) == 0
    assert cache.held(keys) == 2  # its last block went, its prefix stayed
    assert cache.serve(keys, 0.2) == 2


def test_routers_compute_the_floor_with_room_and_more_without() -> None:
    args = options(group_skew=1.0, shared_words=120, context_words=80, arrival_s=5.0, think_s=1.0)
    prompts = trace(args, "x")
    groups = agents(prompts)
    conversations = [[[ord(ch) for ch in prompt] for prompt in turns] for turns in prompts]
    calls = [ids for turns in conversations for ids in turns]
    distinct = {key for ids in calls for key in request_keys(ids, BLOCK, None, None)}
    floor = len(distinct) * BLOCK + sum(len(ids) % BLOCK for ids in calls)
    args.vllm_kv_blocks = 10**6
    hashed, hash_cov = replay(args, conversations, hash_router(0, groups))
    precise, precise_cov = replay(args, conversations, PreciseRouter(0, groups))
    assert hashed == replay(args, conversations, None)[0] == floor
    assert precise > floor and precise_cov < hash_cov
    args.vllm_kv_blocks = 4
    assert replay(args, conversations, hash_router(0, groups))[0] > floor


def test_packing_splits_only_an_agent_larger_than_a_fair_share() -> None:
    groups = [0] * 6 + [1] * 2 + [2] * 2 + [3] * 2  # 12 conversations: a fair share is 4
    route = packed_router(groups)
    picks = [route(n, [], [], [], 0.0) for n in range(len(groups))]
    homes = [{u for u, g in zip(picks, groups, strict=True) if g == agent} for agent in range(4)]
    assert len(homes[0]) == 2 and all(len(h) == 1 for h in homes[1:])
    # the popular agent 3 + 3, then the others each onto the least loaded: 3 + 2, 3, 2 + 2
    assert sorted(picks.count(u) for u in range(3)) == [3, 4, 5]
