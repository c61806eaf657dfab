"""Precise prefix routing: the upstream whose KV-cache events say it holds the longest prefix
of the call, weighed against its load, with llm-d's scorer semantics.

Each available upstream scores a weighted sum (llm-d's precise-prefix-cache profile):

    3 × prefix   matched blocks / the call's blocks (held, or speculative: just routed there)
    2 × KV       1 − its KV-cache usage (scraped)
    2 × queue    1 − (its queue − the least queue) / (the largest − the least); 1 when equal

the highest wins (ties: the lowest index, so every gateway picks alike). An upstream whose
events are not followed (none configured, or its subscription down) scores prefix 0: it
competes on load alone. When no followed upstream holds even one block of the call, the
decision is not this module's: today's placement and hash routing decide (``choice``), so a
new prefix lands where every gateway would put it, and its events then pull the next call
there. Whatever decided, the call's blocks are recorded as speculative on the upstream
chosen (``kv_index.SPECULATIVE_S``) until its events arrive.

Keys carry the call's cache salt and LoRA adapter (``kv_index.request_keys``): one tenant's
blocks never score for another's call, and an upstream can attract a tenant's calls only
with the content it was sent under that tenant's salt.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.upstream.kv_index import BlockIndex, request_keys
from gateway.upstream.kv_subscriber import KVSubscriber
from gateway.upstream.routing import Load

PREFIX_WEIGHT = 3.0
KV_WEIGHT = 2.0
QUEUE_WEIGHT = 2.0
BLOCK_SIZES = (16,)  # keys computed ahead, off the event loop; others on first use


@dataclass
class PromptBlocks:
    """A call's token ids and what keys its blocks: its salt and LoRA adapter."""

    token_ids: list[int]
    lora_name: str | None
    salt: str | None
    _keys: dict[int, list[bytes]] = field(default_factory=dict)

    def keys(self, block_size: int) -> list[bytes]:
        keys = self._keys.get(block_size)
        if keys is None:
            keys = self._keys[block_size] = request_keys(
                self.token_ids, block_size, self.lora_name, self.salt
            )
        return keys


class PreciseScorer:
    def __init__(self, subscriber: KVSubscriber) -> None:
        self.subscriber = subscriber

    def choose(
        self,
        prompt: PromptBlocks,
        urls: Sequence[str],
        loads: Sequence[Load],
        available: Sequence[bool],
        now: float,
    ) -> int | None:
        """The position of the best upstream, or None when no followed one holds a block."""
        matched = [0.0] * len(urls)
        for position, url in enumerate(urls):
            index = self.subscriber.live_index(url)
            if available[position] and index is not None and index.block_size is not None:
                keys = prompt.keys(index.block_size)
                if keys:
                    matched[position] = index.match(keys, now) / len(keys)
        if not any(matched):
            return None
        queues = [max(load.waiting, load.in_flight - load.running) for load in loads]
        open_queues = [q for q, ok in zip(queues, available, strict=True) if ok]
        least, spread = min(open_queues), max(open_queues) - min(open_queues)
        best, best_score = None, -1.0
        for position, load in enumerate(loads):
            if not available[position]:
                continue
            queue = 1.0 if spread == 0 else 1.0 - (queues[position] - least) / spread
            score = (
                PREFIX_WEIGHT * matched[position]
                + KV_WEIGHT * (1.0 - min(1.0, load.kv_usage))
                + QUEUE_WEIGHT * queue
            )
            if score > best_score:
                best, best_score = position, score
        return best

    def routed(self, prompt: PromptBlocks, url: str, now: float) -> None:
        """The call goes to ``url``: its blocks count as there until events say."""
        index: BlockIndex | None = self.subscriber.live_index(url)
        if index is not None:
            index.speculate(prompt.keys(index.block_size or BLOCK_SIZES[0]), now)
