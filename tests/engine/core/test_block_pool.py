import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.engine.core.block_hash import block_hashes, root_hash
from kvgate.engine.core.block_pool import NULL_BLOCK, BlockPool

ROOT = root_hash("test-model", "float32")


def hashes(n: int, seed: int = 0) -> list[bytes]:
    return block_hashes([seed] * (16 * n), ROOT)


def fill(pool: BlockPool, chain: list[bytes], replica: int = 0) -> list[int]:
    """Allocate, register and write (mark ready) a chain of blocks, as one request would."""
    table = pool.allocate(len(chain), replica)
    assert table is not None
    pool.mark_ready(pool.register(zip(table, chain, strict=True), replica))
    return table


def test_free_list_of_never_hashed_blocks_is_used_before_evicting_cached_ones():
    pool = BlockPool(6)
    cached = fill(pool, hashes(2))
    pool.release(cached, 0)
    assert pool.num_cached() == 2
    fresh = pool.allocate(3, 0)
    assert fresh is not None and not set(fresh) & {1, 2}
    assert pool.num_cached() == 2  # nothing evicted while never-hashed blocks remained
    pool.check_invariants()


def test_null_block_is_never_handed_out():
    pool = BlockPool(5)
    blocks = pool.allocate(4, 0)
    assert blocks is not None and NULL_BLOCK not in blocks
    assert pool.allocate(1, 0) is None
    pool.release(blocks, 0)
    pool.check_invariants()


def test_match_reuses_the_longest_cached_prefix_and_stops_at_the_first_miss():
    pool = BlockPool(10)
    chain = hashes(3)
    table = fill(pool, chain)
    pool.release(table[:], 0)
    other = block_hashes([0] * 32 + [7] * 16, ROOT)  # same first two blocks, third differs
    matched = pool.match_and_acquire(other, 0)
    assert matched == table[:2]
    pool.release(matched, 0)
    pool.check_invariants()


def test_release_is_tail_first_so_the_tail_is_evicted_first_and_idempotent():
    pool = BlockPool(4)  # 3 usable blocks
    chain = hashes(3)
    table = fill(pool, chain)
    first, second, third = table
    pool.release(table, 0)
    pool.release(table, 0)  # the table was emptied: a second release does nothing
    assert table == []
    new = pool.allocate(1, 0)
    assert new == [third]  # the tail went into the LRU first
    assert pool.match_and_acquire(chain, 0) == [first, second]
    pool.check_invariants()


def test_evicting_drops_the_map_entry_so_a_reused_block_is_never_matched_stale():
    pool = BlockPool(2)  # one usable block
    chain = hashes(1, seed=1)
    pool.release(fill(pool, chain), 0)
    reused = pool.allocate(1, 0)
    assert reused is not None and chain[0] not in pool.by_hash
    pool.mark_ready(pool.register([(reused[0], hashes(1, seed=2)[0])], 0))
    assert pool.match_and_acquire(chain, 0) == []
    pool.release(reused, 0)
    pool.check_invariants()


def test_duplicate_fill_in_the_same_step_keeps_the_first_block_and_frees_the_twin():
    pool = BlockPool(6)
    chain = hashes(1)
    a, b = pool.allocate(1, 0), pool.allocate(1, 0)
    assert pool.register([(a[0], chain[0])], 0) == [a[0]]
    assert pool.register([(b[0], chain[0])], 0) == []  # tolerated, not mapped twice
    pool.mark_ready(a)
    first, twin = a[0], b[0]
    pool.release(b, 0)
    pool.release(a, 0)
    assert pool.by_hash[chain[0]] == first
    pool.check_invariants()
    assert pool.num_cached() == 1 and twin not in pool.by_hash.values()


def test_pending_blocks_are_visible_only_to_their_owner_until_marked_ready():
    pool = BlockPool(9, num_replicas=2)
    chain = hashes(2)
    table = pool.allocate(2, 0)
    written = pool.register(zip(table, chain, strict=True), 0)
    assert pool.pending_owner(chain[0]) == 0
    assert pool.match_and_acquire(chain, 1) == []
    mine = pool.match_and_acquire(chain, 0)
    assert mine == table
    pool.mark_ready(written)
    assert pool.pending_owner(chain[0]) is None
    theirs = pool.match_and_acquire(chain, 1)
    assert theirs == table
    for t, r in ((mine, 0), (theirs, 1), (table, 0)):
        pool.release(t, r)
    pool.check_invariants()


def test_a_pending_block_released_before_it_was_written_is_uncached():
    pool = BlockPool(4)
    chain = hashes(1)
    table = pool.allocate(1, 0)
    pool.register([(table[0], chain[0])], 0)
    pool.release(table, 0)
    assert chain[0] not in pool.by_hash and pool.num_cached() == 0
    pool.check_invariants()


def test_each_replica_keeps_a_fair_share_of_blocks():
    pool = BlockPool(9, num_replicas=2)  # 8 usable, share 4 each
    greedy = pool.allocate(4, 0)
    assert pool.allocate(1, 0) is None  # the rest is replica 1's guarantee
    theirs = pool.allocate(2, 1)
    assert theirs is not None
    borrowed = pool.allocate(2, 1)  # replica 0's guarantee is met: 1 may use the rest
    assert borrowed is not None and pool.allocate(1, 0) is None
    for table, replica in ((greedy, 0), (theirs, 1), (borrowed, 1)):
        pool.release(table, replica)
    pool.check_invariants()


def test_allocate_keeps_the_requested_reserve():
    pool = BlockPool(6)
    assert pool.allocate(4, 0, reserve=2) is None
    table = pool.allocate(4, 0)
    assert table is not None
    pool.release(table, 0)


def test_releasing_a_block_not_held_is_an_error():
    pool = BlockPool(4)
    with pytest.raises(RuntimeError, match="does not hold"):
        pool.release([1], 0)


ops = st.lists(
    st.tuples(
        st.sampled_from(["match", "allocate", "register", "ready", "release"]),
        st.integers(0, 1),  # replica
        st.integers(0, 5),  # which prompt / how many blocks
        st.integers(0, 7),  # which held table
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operation_sequences_keep_the_invariants(sequence):
    pool = BlockPool(12, num_replicas=2)
    prompts = [hashes(4, seed) for seed in range(3)] + [block_hashes([0] * 32 + [9] * 32, ROOT)]
    tables: list[tuple[int, list[int], list[bytes]]] = []  # (replica, blocks, chain)
    pending: list[int] = []
    for op, replica, k, t in sequence:
        if op == "match":
            chain = prompts[k % len(prompts)]
            tables.append((replica, pool.match_and_acquire(chain, replica), chain))
        elif op == "allocate":
            got = pool.allocate(k, replica)
            if got is not None:
                tables.append((replica, got, prompts[k % len(prompts)]))
        elif op == "register" and tables:
            owner, blocks, chain = tables[t % len(tables)]
            pending += pool.register(zip(blocks, chain, strict=False), owner)
        elif op == "ready":
            pool.mark_ready(pending)
            pending.clear()
        elif op == "release" and tables:
            owner, blocks, _ = tables.pop(t % len(tables))
            pool.release(blocks, owner)
        pool.check_invariants()
    pool.mark_ready(pending)
    for owner, blocks, _ in tables:
        pool.release(blocks, owner)
    pool.check_invariants()
    assert pool.num_in_use() == 0


def test_concurrent_replicas_keep_the_invariants():
    pool = BlockPool(40, num_replicas=4)
    shared = hashes(3)
    errors: list[BaseException] = []

    def worker(replica: int) -> None:
        try:
            for i in range(300):
                chain = shared + hashes(2, seed=replica * 1000 + i % 5)[1:]
                table = pool.match_and_acquire(chain, replica)
                fresh = pool.allocate(len(chain) - len(table), replica)
                if fresh is None:
                    pool.release(table, replica)
                    continue
                written = pool.register(zip(fresh, chain[len(table) :], strict=True), replica)
                pool.mark_ready(written)
                table += fresh
                pool.release(table, replica)
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    pool.check_invariants()
    assert pool.num_in_use() == 0
