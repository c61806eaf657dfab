"""Precise prefix routing: the upstream where a call costs the least prefill, now and at the
conversation's next turn, as the upstreams' KV-cache events tell, within a bound on imbalance.

Each available upstream below the load bound is costed in prompt tokens to compute:

    uncached     the call's tokens beyond the prefix it holds (held, or speculative: just
                 routed there)
    + at risk    the call's tokens × the chance that a block stored there now is evicted
                 before the conversation's next turn (``BlockIndex.eviction_odds``: from
                 the blocks it removed over the last ~10 s against the blocks it holds)
    + queued     its requests × half the tokens a call computed on average lately (a
                 request there has, on average, half of its prefill still to compute)
    + crowded    the uncached tokens × 4 × how far the prompt tokens this gateway sent
                 it lately exceed a fair share (``Demand``: 1 at twice the share, 0 at or
                 below it)

and the cheapest wins (ties: the lowest index, so every gateway picks alike). An upstream
whose running requests fill its KV cache (scraped) takes a call only when every one does.

Why costs, not llm-d's weighted scores (3 × prefix share + 2 × free KV + 2 × free queue):
measured where caches evict (benchmarks/fleet_eviction.py), one request more on a
conversation's upstream outweighed its whole history there, so turns left their history
and the caches evicted; in tokens, a history of 1,000 outweighs a queued request worth 75.
A shared prompt cached everywhere lowers every upstream's cost alike and decides nothing.

Why the risk: a cache smaller than the conversations sent to it removes blocks as fast as
it stores them. A router that follows only where blocks are keeps sending a popular agent's
conversations to the upstream holding its prompt, where each evicts another's history.
Counting the history as likely lost there moves new conversations, and those whose history
is already gone, to an upstream that keeps what it holds; one whose history is held moves
only when that history would likely be evicted before it is read again.

Why the risk follows LRU: an engine evicts its least recently used blocks first, and a call's
blocks are the newest, so an upstream that removes a third of what it holds every ~10 s
still keeps a conversation paused for a few seconds. Counting the removals over the blocks
held as the odds (as this cost first did) moved a twelfth of the turns of a trace whose
caches evicted off histories they would have kept (benchmarks/fleet_eviction.py).

Why the crowding: between an agent's turns its upstream runs nothing, so requests in flight
say nothing of the conversations it must keep cached. Without this term a popular agent's
new conversations all followed its prompt to one upstream until that one evicted, and the
upstreams' prompt tokens spread with a CoV of 0.2 (benchmarks/fleet_eviction.py). It weighs
what the call would bring anew to an upstream's cache, four times over: a new conversation,
holding only the agent's prompt, moves to a copy of that prompt at any crowding, or to an
upstream holding nothing once its upstream has about 1.25 times a fair share (when its own
part is about as long as the prompt); one whose history is held stays, since moving it would
recompute that history now for a balance the next new conversations reach anyway. Weighed
on the whole call, crowding moved held conversations and cost more prefill than it saved;
weighed once on the new tokens, an upstream holding no popular prompt took new
conversations only at twice a fair share elsewhere (load CoV 0.17).

Why a bound: the scraped requests are seconds old, so a burst of calls sharing a prefix
from several gateways would all go to the upstream holding it before any scrape could say
that it is busy. An upstream's requests are this gateway's own calls there (counted live,
by their leases) or, when larger, what its last scrape reported (every gateway's); it may
take a call only while they are below ceil(2 × (all requests + 1) / available upstreams),
so the least loaded one always may, and never below ``BOUND_FLOOR``. Twice a fair share, not
the hash router's 1.25 (``kvgate.engine.core.router.PrefixRouter.load_bound``): the queue
term already spreads load, and at 1.25 the bound, met on a scrape's stale count, made a
third to a half of the moves that left a conversation's history behind.

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

from kvgate.gateway.upstream.decaying import DecayingSum
from kvgate.gateway.upstream.kv_index import BlockIndex, request_keys
from kvgate.gateway.upstream.kv_subscriber import KVSubscriber
from kvgate.gateway.upstream.routing import KV_FULL, Load

LOAD_FACTOR = 2.0  # a safety net under the cost's own queue term: twice a fair share
BOUND_FLOOR = 4  # an engine batches this many requests at no cost: no bound below it
BLOCK_SIZES = (16,)  # keys computed ahead, off the event loop; others on first use
CALL_COST_DECAY = 0.9  # the average call's tokens: each routed call weighs 1 − this
QUEUED_SHARE = 0.5  # a request there still has, on average, half of its prefill to compute
DEMAND_HALF_LIFE_S = 30.0  # "lately", for the prompt tokens sent each upstream: a few turns
DEMAND_PRIOR_CALLS = 4  # each upstream's share counts this many average calls more
CROWDING_WEIGHT = 4.0  # a new conversation leaves an upstream ~1.25 times its fair share


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


@dataclass(frozen=True, slots=True)
class Holding:
    """What one upstream holds of a call, as its events tell."""

    cached_tokens: int = 0  # the call's tokens, from the first, held there
    eviction_odds: float = 0.0  # the chance a block stored there now is soon evicted


def cost(
    tokens: int, holding: Holding, requests: int, call_tokens: float, crowding: float = 0.0
) -> float:
    """Prompt tokens the call costs an upstream: its uncached ones, those likely recomputed
    at the next turn, the calls queued ahead, and its crowding (``Demand.crowding``) on what
    the call would newly bring to that upstream's cache."""
    uncached = tokens - holding.cached_tokens
    at_risk = tokens * holding.eviction_odds
    queued = requests * QUEUED_SHARE * call_tokens
    return uncached + at_risk + queued + uncached * CROWDING_WEIGHT * crowding


class Demand:
    """The prompt tokens this gateway sent each upstream lately (halving every
    ``DEMAND_HALF_LIFE_S``): what each must keep cached for the conversations routed there.
    Keyed by the upstreams' URLs; an entry faded below one token is dropped.

    Each upstream's share counts ``DEMAND_PRIOR_CALLS`` average calls more than it was sent:
    with a handful of calls sent, one upstream's share is all or nothing, and without the
    prior the first call's upstream would count as crowded at three times a fair share."""

    def __init__(self) -> None:
        self._sent: dict[str, DecayingSum] = {}
        self._calls = DecayingSum.with_half_life(DEMAND_HALF_LIFE_S)

    def add(self, url: str, tokens: int, now: float) -> None:
        self._recent(now)
        self._sent.setdefault(url, DecayingSum.with_half_life(DEMAND_HALF_LIFE_S)).add(tokens, now)
        self._calls.add(1, now)

    def crowding(self, urls: Sequence[str], available: Sequence[bool], now: float) -> list[float]:
        """Per upstream, how far its share of the available upstreams' recent tokens exceeds
        a fair one, as a fraction of that share (0 when at or below it; 0 when unavailable)."""
        recent = self._recent(now)
        calls = self._calls.value(now)
        if calls <= 0 or not any(available):
            return [0.0] * len(urls)
        prior = DEMAND_PRIOR_CALLS * sum(recent.values()) / calls
        sent = [recent.get(url, 0.0) + prior for url in urls]
        total = sum(tokens for tokens, ok in zip(sent, available, strict=True) if ok)
        fair = total / sum(available)
        return [
            max(0.0, tokens / fair - 1) if ok and fair > 0 else 0.0
            for tokens, ok in zip(sent, available, strict=True)
        ]

    def _recent(self, now: float) -> dict[str, float]:
        """Each upstream's recent tokens, read once; those faded below one are forgotten."""
        recent = {url: sent.value(now) for url, sent in self._sent.items()}
        recent = {url: tokens for url, tokens in recent.items() if tokens >= 1}
        self._sent = {url: self._sent[url] for url in recent}
        return recent


def best(
    tokens: int,
    holdings: Sequence[Holding],
    loads: Sequence[Load],
    available: Sequence[bool],
    call_tokens: float,
    crowding: Sequence[float] | None = None,
) -> int:
    """The position of the cheapest available upstream below the load bound (a full KV
    cache only where every such one is full) for a call of ``tokens`` prompt tokens, given
    what each holds, the average call's tokens (``call_tokens``) and each one's crowding
    (none: no upstream is)."""
    bound = load_bound(loads, available)
    below = [ok and load.total < bound for ok, load in zip(available, loads, strict=True)]
    roomy = [ok and load.kv_usage < KV_FULL for ok, load in zip(below, loads, strict=True)]
    candidates = roomy if any(roomy) else below
    choice, cheapest = -1, math.inf
    for position, load in enumerate(loads):
        if candidates[position]:
            crowded = crowding[position] if crowding is not None else 0.0
            price = cost(tokens, holdings[position], load.total, call_tokens, crowded)
            if price < cheapest:
                choice, cheapest = position, price
    return choice


def call_average(average: float, tokens: int) -> float:
    """The tokens a call computes on average, ``average`` (0: none yet) and one more call of
    ``tokens``, each call weighing ``1 − CALL_COST_DECAY``: the queue term's unit."""
    if not average:
        return float(tokens)
    return CALL_COST_DECAY * average + (1 - CALL_COST_DECAY) * tokens


class PreciseScorer:
    def __init__(self, subscriber: KVSubscriber) -> None:
        self.subscriber = subscriber
        self.call_tokens = 0.0  # what a call routed here computes, on average (decayed)
        self.demand = Demand()

    def choose(
        self,
        prompt: PromptBlocks,
        urls: Sequence[str],
        loads: Sequence[Load],
        available: Sequence[bool],
        now: float,
    ) -> int | None:
        """The position of the best upstream, or None when no followed one holds a block."""
        holdings = [Holding()] * len(urls)
        for position, url in enumerate(urls):
            index = self.subscriber.live_index(url)
            if available[position] and index is not None and index.block_size is not None:
                keys = prompt.keys(index.block_size)
                holdings[position] = Holding(
                    index.match(keys, now) * index.block_size, index.eviction_odds(now)
                )
        tokens = len(prompt.token_ids)
        if not any(h.cached_tokens for h in holdings):
            self._computed(tokens)  # wherever it goes
            return None
        crowding = self.demand.crowding(urls, available, now)
        position = best(tokens, holdings, loads, available, self.call_tokens or tokens, crowding)
        self._computed(tokens - holdings[position].cached_tokens)
        return position

    def routed(self, prompt: PromptBlocks, url: str, now: float) -> None:
        """The call goes to ``url``: its blocks count as there until events say, and its
        tokens as that upstream's demand."""
        self.demand.add(url, len(prompt.token_ids), now)
        index: BlockIndex | None = self.subscriber.live_index(url)
        if index is not None:
            index.speculate(prompt.keys(index.block_size or BLOCK_SIZES[0]), now)

    def _computed(self, tokens: int) -> None:
        self.call_tokens = call_average(self.call_tokens, tokens)
