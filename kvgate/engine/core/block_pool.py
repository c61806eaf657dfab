"""The KV block pool shared by every replica: who holds which block, and what it caches.

The pool is the mechanism; schedulers are the policy. Each block is in exactly one place:

    free      ref 0, no hash        never-hashed blocks, handed out first
    lru       ref 0, hash, ready    cached and evictable, least recently released first
    in use    ref > 0               held by one or more requests (maybe of several replicas)

A hashed block is *pending* until the step that writes it has finished (`mark_ready`); only
its owner replica may match it meanwhile, so no replica reads K/V that is not there yet.
Fair share: each of N replicas is guaranteed ``usable // N`` blocks; a replica may borrow
beyond its share only while enough blocks stay available to honour every other replica's
unmet guarantee. One lock guards all of it; nothing here touches a device.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from kvgate.engine.core.kv_events import KVEventLog

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int, num_replicas: int = 1):
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory: room for {num_blocks} blocks, need at least 2")
        if num_replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {num_replicas}")
        self.num_blocks = num_blocks
        self.num_replicas = num_replicas
        self.share = (num_blocks - 1) // num_replicas
        self._lock = threading.Lock()
        self._ref = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._ready = [False] * num_blocks
        self._owner = [-1] * num_blocks  # replica that allocated (and so writes) the block
        self._replica_refs = [[0] * num_replicas for _ in range(num_blocks)]
        self._held = [0] * num_replicas  # distinct blocks each replica holds
        self.by_hash: dict[bytes, int] = {}
        self._free: deque[int] = deque(range(1, num_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.events: KVEventLog | None = None  # told what is stored and removed, when set

    # -- queries ---------------------------------------------------------------------------

    def num_in_use(self) -> int:
        with self._lock:
            return self.num_blocks - 1 - len(self._free) - len(self._lru)

    def num_held(self, replica: int) -> int:
        """Distinct blocks ``replica``'s requests hold."""
        with self._lock:
            return self._held[replica]

    def num_cached(self) -> int:
        with self._lock:
            return len(self._lru)

    def pending_owner(self, block_hash: bytes) -> int | None:
        """The replica writing this block now, if it is pending (for prefix routing)."""
        with self._lock:
            block = self.by_hash.get(block_hash)
            if block is None or self._ready[block]:
                return None
            return self._owner[block]

    # -- operations ------------------------------------------------------------------------

    def match_and_acquire(self, hashes: Sequence[bytes], replica: int) -> list[int]:
        """Take a reference on the longest run of cached blocks matching ``hashes``."""
        blocks: list[int] = []
        with self._lock:
            for block_hash in hashes:
                block = self.by_hash.get(block_hash)
                if block is None or not (self._ready[block] or self._owner[block] == replica):
                    break
                if self._ref[block] == 0 and self._available(replica) < 1:
                    break  # reviving a cached block spends capacity like an allocation
                self._acquire(block, replica)
                blocks.append(block)
        return blocks

    def allocate(self, n: int, replica: int, reserve: int = 0) -> list[int] | None:
        """``n`` fresh blocks (free list first, then evicting the LRU), or None if fewer than
        ``n + reserve`` are available to ``replica``."""
        with self._lock:
            if n + reserve > self._available(replica):
                return None
            blocks = []
            for _ in range(n):
                if self._free:
                    block = self._free.popleft()
                else:
                    block, _ = self._lru.popitem(last=False)
                    self._uncache(block)
                self._owner[block] = replica
                self._ready[block] = False
                self._acquire(block, replica)
                blocks.append(block)
            return blocks

    def register(self, entries: Iterable[tuple[int, bytes]], replica: int) -> list[int]:
        """Publish (block, hash) pairs as pending; returns the blocks registered. A hash that
        is already mapped (two requests filled the same prefix at once) keeps its first block;
        the duplicate stays unhashed and is freed as plain storage later."""
        registered = []
        with self._lock:
            for block, block_hash in entries:
                if block_hash in self.by_hash or self._hash[block] is not None:
                    continue
                self._hash[block] = block_hash
                self._ready[block] = False
                self._owner[block] = replica
                self.by_hash[block_hash] = block
                registered.append(block)
        return registered

    def mark_ready(self, blocks: Iterable[int]) -> None:
        """The step that wrote these blocks has finished: every replica may now match them."""
        blocks = list(blocks)
        with self._lock:
            for block in blocks:
                self._ready[block] = True
            if self.events is not None:
                self.events.written(blocks)

    def release(self, table: list[int], replica: int) -> None:
        """Drop ``replica``'s references on ``table``, tail first, and empty it (so a second
        call is a no-op). A pending block that falls to ref 0 was never written: uncached."""
        with self._lock:
            while table:
                block = table.pop()
                self._drop(block, replica)
                if self._ref[block] > 0:
                    continue
                if self._hash[block] is not None and self._ready[block]:
                    self._lru[block] = None  # released tail first => tail evicted first
                else:
                    self._uncache(block)
                    self._owner[block] = -1
                    self._free.append(block)

    # -- internals (lock held) --------------------------------------------------------------

    def _available(self, replica: int) -> int:
        reserved = sum(
            max(0, self.share - held) for r, held in enumerate(self._held) if r != replica
        )
        return max(0, len(self._free) + len(self._lru) - reserved)

    def _acquire(self, block: int, replica: int) -> None:
        if self._ref[block] == 0:
            self._lru.pop(block, None)
        self._ref[block] += 1
        refs = self._replica_refs[block]
        if refs[replica] == 0:
            self._held[replica] += 1
        refs[replica] += 1

    def _drop(self, block: int, replica: int) -> None:
        refs = self._replica_refs[block]
        if block == NULL_BLOCK or refs[replica] <= 0:
            raise RuntimeError(f"replica {replica} released block {block} it does not hold")
        refs[replica] -= 1
        if refs[replica] == 0:
            self._held[replica] -= 1
        self._ref[block] -= 1

    def _uncache(self, block: int) -> None:
        """Forget a block's hash; the map entry goes only if it still points at this block."""
        block_hash = self._hash[block]
        if block_hash is not None and self.by_hash.get(block_hash) == block:
            del self.by_hash[block_hash]
        if block_hash is not None and self.events is not None:
            self.events.uncached(block, block_hash, self._ready[block])
        self._hash[block] = None
        self._ready[block] = False

    # -- tests -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (for tests)."""
        with self._lock:
            free, lru = set(self._free), set(self._lru)
            assert len(free) == len(self._free), "duplicate block in the free list"
            assert not free & lru, "block both free and cached"
            assert NULL_BLOCK not in free | lru and self._ref[NULL_BLOCK] == 0, "null block used"
            assert self._hash[NULL_BLOCK] is None, "null block hashed"
            for block in range(1, self.num_blocks):
                ref, block_hash = self._ref[block], self._hash[block]
                assert ref == sum(self._replica_refs[block]) and ref >= 0, f"block {block} refs"
                if block in free:
                    assert ref == 0 and block_hash is None, f"free block {block} is not clean"
                elif block in lru:
                    assert ref == 0 and block_hash is not None and self._ready[block], (
                        f"cached block {block} is not a ready hashed block"
                    )
                else:
                    assert ref > 0, f"block {block} leaked: unreferenced, neither free nor cached"
                if block_hash is not None:
                    assert self.by_hash.get(block_hash) == block, f"block {block} not in by_hash"
            for block_hash, block in self.by_hash.items():
                assert self._hash[block] == block_hash, f"stale by_hash entry for block {block}"
            for replica in range(self.num_replicas):
                held = sum(1 for refs in self._replica_refs if refs[replica] > 0)
                assert held == self._held[replica], f"replica {replica} holds {held} blocks"
