"""Precise prefix routing: the upstream whose KV-cache events say it holds the most of the
call's prefix that the others lack, weighed against its load, within a bound on imbalance.

Each available upstream whose load is below the bound scores a weighted sum (the weights of
llm-d's precise-prefix-cache profile):

    3 × prefix   its share of the call's blocks beyond the share every available upstream
                 holds, over the rest (held, or speculative: just routed there); 0 when none
    2 × KV       1 − its KV-cache usage (scraped)
    2 × queue    1 − its requests / the bound

the highest wins (ties: the lowest index, so every gateway picks alike). Why not llm-d's
plain prefix share: an agent's shared prompt is cached everywhere, so it lifts every
upstream alike and the difference that matters, the conversation's own blocks, is a small
part of the share; measured where caches evict (benchmarks/fleet_eviction.py) the load terms
then outweighed it, turns left the upstream holding their history, and the caches evicted.
Counted on the distinguishing blocks, a conversation's turns stay where its history is.

Why a bound: the scraped load terms are seconds old, so a burst of calls sharing a prefix
would all go to the upstream holding it before any scrape could say that it is full. An
upstream's requests are this gateway's own calls there (counted live, by their leases) or,
when larger, what its last scrape reported (every gateway's); like the hash router's
bounded loads (``kvgate.engine.core.router.PrefixRouter.load_bound``) an upstream may take a call
only while its requests are below ceil(1.25 × (all requests + 1) / available upstreams), so
the least loaded one always may; never below ``BOUND_FLOOR``, as an idle fleet's bound of 1
would send a call away from its blocks for one request, or a scrape's stale one.

An upstream whose events are not followed (none configured, or its subscription down) holds
no block here: it competes on load alone. When no followed upstream holds even one block of
the call, the decision is not this module's: today's placement and hash routing decide
(``choice``), so a new prefix lands where every gateway would put it. Whatever decided, the
call's blocks are recorded as speculative on the upstream chosen (``kv_index.SPECULATIVE_S``)
until its events arrive.

Keys carry the call's cache salt and LoRA adapter (``kv_index.request_keys``): one tenant's
blocks never score for another's call, and an upstream can attract a tenant's calls only
with the content it was sent under that tenant's salt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvgate.gateway.upstream.kv_index import BlockIndex, request_keys
from kvgate.gateway.upstream.kv_subscriber import KVSubscriber
from kvgate.gateway.upstream.routing import Load

PREFIX_WEIGHT = 3.0
KV_WEIGHT = 2.0
QUEUE_WEIGHT = 2.0
LOAD_FACTOR = 1.25  # as the hash router's bounded loads
BOUND_FLOOR = 4  # an engine batches this many requests at no cost: no bound below it
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


def load_bound(loads: Sequence[Load], available: Sequence[bool]) -> int:
    """The requests an available upstream must be below to take one more call."""
    open_totals = [load.total for load, ok in zip(loads, available, strict=True) if ok]
    return max(BOUND_FLOOR, math.ceil(LOAD_FACTOR * (sum(open_totals) + 1) / len(open_totals)))


def best(shares: Sequence[float], loads: Sequence[Load], available: Sequence[bool]) -> int:
    """The position of the highest scoring available upstream below the load bound, given
    the share of the call's blocks each holds from the first (``shares``)."""
    common = min(s for s, ok in zip(shares, available, strict=True) if ok)
    distinct = 1.0 - common
    bound = load_bound(loads, available)
    choice, top = -1, -math.inf
    for position, load in enumerate(loads):
        if not available[position] or load.total >= bound:
            continue
        prefix = (shares[position] - common) / distinct if distinct > 0 else 0.0
        score = (
            PREFIX_WEIGHT * prefix
            + KV_WEIGHT * (1.0 - min(1.0, load.kv_usage))
            + QUEUE_WEIGHT * (1.0 - load.total / bound)
        )
        if score > top:
            choice, top = position, score
    return choice


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
        shares = [0.0] * len(urls)
        for position, url in enumerate(urls):
            index = self.subscriber.live_index(url)
            if available[position] and index is not None and index.block_size is not None:
                keys = prompt.keys(index.block_size)
                if keys:
                    shares[position] = index.match(keys, now) / len(keys)
        if not any(shares):
            return None
        return best(shares, loads, available)

    def routed(self, prompt: PromptBlocks, url: str, now: float) -> None:
        """The call goes to ``url``: its blocks count as there until events say."""
        index: BlockIndex | None = self.subscriber.live_index(url)
        if index is not None:
            index.speculate(prompt.keys(index.block_size or BLOCK_SIZES[0]), now)
