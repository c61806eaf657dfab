"""One replica's view of the shared BlockPool: block tables of its requests, prefix matches,
and which blocks a step publishes.

    request.token_ids   [ t0 .. t15 | t16 .. t31 | t32 .. t40 ]
    request.block_table [    b7     |    b3      |    b9      ]   (append-only)
    published (hashed)  [   yes     |    yes     |    no: not full yet ]

A prompt reuses every cached full block, and its last token is always computed (its logits
are needed): where the cached blocks hold that token too (a fully cached prompt of whole
blocks), it runs as a one-token query over them and its K/V, already there, is not written
(`Request.num_cached`). vLLM recomputes the whole last block then: 16 rows against one,
and a rewrite of a shared block could change what other requests read.
"""

from __future__ import annotations

from kvgate.engine.core.block_hash import extend_block_hashes
from kvgate.engine.core.block_pool import BlockPool
from kvgate.engine.core.request import Request


class KVCacheManager:
    def __init__(
        self,
        pool: BlockPool,
        replica: int,
        block_size: int,
        enable_prefix_caching: bool = True,
    ):
        self.pool = pool
        self.replica = replica
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # prompt tokens looked up, cumulative
        self.prefix_hits = 0  # of those, found cached

    def match_prefix(self, request: Request) -> int:
        """Acquire the cached blocks of the request's leading full blocks; returns the number
        of tokens they cover (0 with prefix caching off)."""
        if not self.enable_prefix_caching:
            return 0
        full = request.num_tokens // self.block_size
        hashes = self._hashes(request, full)
        blocks = self.pool.match_and_acquire(hashes[:full], self.replica)
        request.block_table = blocks
        request.num_registered_blocks = len(blocks)
        request.num_cached = len(blocks) * self.block_size
        request.num_computed = min(request.num_cached, request.num_tokens - 1)
        return request.num_computed

    def record_lookup(self, request: Request, hit_tokens: int) -> None:
        """Count an admitted request's lookup in the prefix-cache counters."""
        if self.enable_prefix_caching:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int, reserve: int = 0) -> bool:
        """Grow the block table to hold ``num_new_tokens`` more tokens; False when the pool
        cannot spare the blocks (keeping ``reserve`` available)."""
        needed = -(-(request.num_computed + num_new_tokens) // self.block_size)
        missing = needed - len(request.block_table)
        if missing <= 0:
            return True
        blocks = self.pool.allocate(missing, self.replica, reserve)
        if blocks is None:
            return False
        request.block_table.extend(blocks)
        return True

    def publish_full_blocks(self, request: Request, num_new_tokens: int) -> list[int]:
        """Register (pending) the blocks this step's tokens complete; returns those the pool
        took, to be marked ready once the step has written them."""
        if not self.enable_prefix_caching:
            return []
        full = (request.num_computed + num_new_tokens) // self.block_size
        start = request.num_registered_blocks
        if full <= start:
            return []
        hashes = self._hashes(request, full)
        request.num_registered_blocks = full
        entries = list(zip(request.block_table[start:full], hashes[start:full], strict=True))
        registered = self.pool.register(entries, self.replica)
        if self.pool.events is not None and registered:
            self._tell_registered(request, start, set(registered))
        return registered

    def _tell_registered(self, request: Request, start: int, registered: set[int]) -> None:
        """The pool's event log learns what the newly registered blocks will hold."""
        events, size, hashes = self.pool.events, self.block_size, request.block_hashes
        assert events is not None
        lora = None if request.lora is None else request.lora.name
        for index in range(start, request.num_registered_blocks):
            block = request.block_table[index]
            if block in registered:
                parent = hashes[index - 1] if index else None
                tokens = request.token_ids[index * size : (index + 1) * size]
                events.registered(block, hashes[index], parent, tokens, lora, request.cache_salt)

    def trim(self, request: Request) -> None:
        """Release the blocks past the request's tokens, which held only drafts it rejected:
        never published (`publish_full_blocks` counts verified tokens only), they go back to
        the free list as plain storage."""
        keep = -(-request.num_tokens // self.block_size)
        if len(request.block_table) > keep:
            tail = request.block_table[keep:]
            del request.block_table[keep:]
            self.pool.release(tail, self.replica)

    def mark_written(self, blocks: list[int]) -> None:
        """The step has written these pending blocks: other replicas may now match them."""
        self.pool.mark_ready(blocks)

    @property
    def usage(self) -> float:
        """This replica's share of the pool's usable blocks in use, 0.0 to 1.0."""
        return self.pool.num_held(self.replica) / (self.pool.num_blocks - 1)

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first; cached ones stay matchable). Idempotent."""
        self.pool.release(request.block_table, self.replica)
        request.num_registered_blocks = 0
        request.num_computed = request.num_cached = 0

    def _hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        if len(request.block_hashes) < num_blocks:
            extend_block_hashes(
                request.block_hashes, request.token_ids, request.hash_root, self.block_size
            )
        return request.block_hashes
