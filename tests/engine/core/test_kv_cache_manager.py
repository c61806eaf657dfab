from kvgate.engine.core.block_pool import BlockPool
from kvgate.engine.core.kv_cache_manager import KVCacheManager
from tests.engine.scheduling_helpers import make_request


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 31 + i) % 500 + 3 for i in range(n)]


def compute(kv: KVCacheManager, request, n: int) -> list[int]:
    """What a step does for one request: slots, publish, (write), advance."""
    assert kv.allocate_slots(request, n)
    written = kv.publish_full_blocks(request, n)
    request.num_computed += n
    return written


def test_block_table_grows_one_block_per_16_tokens():
    kv = KVCacheManager(BlockPool(16), 0, 16)
    request = make_request(tokens(20))
    assert kv.allocate_slots(request, 20)
    assert len(request.block_table) == 2
    request.num_computed = 20
    assert kv.allocate_slots(request, 12) and len(request.block_table) == 2
    assert kv.allocate_slots(request, 13) and len(request.block_table) == 3
    kv.free(request)


def test_only_full_blocks_are_published_and_they_stay_pending_until_marked_ready():
    pool = BlockPool(16, num_replicas=2)
    kv, other = KVCacheManager(pool, 0, 16), KVCacheManager(pool, 1, 16)
    first = make_request(tokens(40))
    written = compute(kv, first, 40)
    assert written == first.block_table[:2]
    twin = make_request(tokens(40))
    assert other.match_prefix(twin) == 0  # pending: invisible to other replicas
    pool.mark_ready(written)
    assert other.match_prefix(twin) == 32
    assert twin.block_table == first.block_table[:2]
    kv.free(first)
    other.free(twin)
    pool.check_invariants()


def test_a_fully_cached_prompt_computes_only_its_last_token_and_writes_nothing():
    pool = BlockPool(16)
    kv = KVCacheManager(pool, 0, 16)
    first = make_request(tokens(48))
    pool.mark_ready(compute(kv, first, 48))
    cached = list(first.block_table)
    kv.free(first)
    again = make_request(tokens(48))
    assert kv.match_prefix(again) == 47  # the last token is computed, for its logits
    assert again.num_cached == 48 and again.block_table == cached  # its K/V all cached
    assert compute(kv, again, 1) == [] and again.block_table == cached  # no new block
    kv.free(again)
    assert again.num_cached == 0
    longer = make_request(tokens(50))  # past the cached blocks: they are matched, the rest run
    assert kv.match_prefix(longer) == 48 and longer.num_cached == 48
    kv.free(longer)
    pool.check_invariants()


def test_free_is_idempotent_and_keeps_written_blocks_cached():
    pool = BlockPool(16)
    kv = KVCacheManager(pool, 0, 16)
    request = make_request(tokens(35))
    pool.mark_ready(compute(kv, request, 35))
    kv.free(request)
    kv.free(request)
    assert pool.num_in_use() == 0 and pool.num_cached() == 2
    pool.check_invariants()


def test_with_prefix_caching_off_nothing_is_matched_or_published():
    pool = BlockPool(16)
    kv = KVCacheManager(pool, 0, 16, enable_prefix_caching=False)
    request = make_request(tokens(40))
    assert compute(kv, request, 40) == []
    kv.free(request)
    assert kv.match_prefix(make_request(tokens(40))) == 0
    assert pool.num_cached() == 0 and not pool.by_hash


def test_allocation_failure_leaves_the_table_unchanged():
    kv = KVCacheManager(BlockPool(3), 0, 16)  # two usable blocks
    request = make_request(tokens(40))
    assert not kv.allocate_slots(request, 40)
    assert request.block_table == []
    assert kv.allocate_slots(request, 32) and len(request.block_table) == 2
    kv.free(request)


def test_prefix_counters_count_admitted_lookups_in_tokens():
    pool = BlockPool(16)
    kv = KVCacheManager(pool, 0, 16)
    request = make_request(tokens(40))
    pool.mark_ready(compute(kv, request, 40))
    kv.free(request)
    again = make_request(tokens(40))
    kv.record_lookup(again, kv.match_prefix(again))
    assert (kv.prefix_queries, kv.prefix_hits) == (40, 32)
    kv.free(again)
