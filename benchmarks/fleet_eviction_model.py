"""What routing can reach on the eviction trace when engines evict least recently used blocks:
the trace of ``fleet_eviction`` replayed through a model of three prefix caches, no engine.

The eviction benchmark runs real engines, one placement of the agents at a time, for minutes;
its figures mix what a router decides with when the engines answer. This model keeps only the
caches: each upstream holds ``--vllm-kv-blocks`` blocks of 128 tokens and evicts the least
recently used, a request's own blocks tail first (as vLLM frees them, so its prefix stays
longest); a call computes its tokens from its first block not held. Calls arrive as the trace
starts and pauses them, each answered ``ANSWER_S`` after it is sent. Four routers:

    hash      each agent's conversations on one upstream, drawn at random per placement
              (where a prefix hash puts them: kvgate approximate, without overflow)
    packed    the agents placed once by their known popularity, largest first, each on the
              upstream with the fewest conversations; one with more than a fair share is
              split over the two with the fewest (what a placement costed by cache space
              could reach, knowing the trace ahead)
    precise   kvgate's precise cost (``kvgate.gateway.upstream.precise``) on what each cache
              holds and evicts, known at once (no event lag, no queue)
    pooled    one cache as large as the three: what upstreams sharing their KV blocks, as a
              KV connector between engines does, would compute under any router

Why a model: it answers in seconds what the real benchmark answers in twenty minutes, and it
separates the caches' part from the engines'. It is not a bound: LRU is not the best a cache
could do. Its hash router lands within a few percent of kvgate approximate's real medians; its
precise router about a tenth below the real one, which waits for events and weighs queues.

    python benchmarks/fleet.py --workload eviction-model --upstreams vllm --sessions 48 \
        --context-words 300 --vllm-kv-blocks 80 --groups 6 --group-skew 1 --arrival-s 60 \
        --think-s 2 --placements 6
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from collections import OrderedDict
from collections.abc import Callable

from benchmarks.fleet import cov
from benchmarks.fleet_eviction import (
    PRECISE,
    floor_tokens,
    pauses,
    starts,
    trace,
    upstream_tokenizer,
)
from kvgate.gateway.upstream.decaying import DecayingSum
from kvgate.gateway.upstream.kv_index import EVICTION_WINDOW_S, eviction_odds, request_keys
from kvgate.gateway.upstream.precise import Demand, Holding, best, call_average
from kvgate.gateway.upstream.routing import Load

BLOCK = 128  # vLLM's block size on CPU
ANSWER_S = 0.15  # a call's time to its answer: the tiny model's, on 2 cores
UPSTREAMS = 3


class LruCache:
    """An engine's prefix cache: ``capacity`` blocks, the least recently used evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.evicted = DecayingSum(EVICTION_WINDOW_S)

    def held(self, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, are held."""
        return next((n for n, key in enumerate(keys) if key not in self.blocks), len(keys))

    def serve(self, keys: list[bytes], now: float) -> int:
        """A call with these blocks: the blocks it found, then all of them stored."""
        found = self.held(keys)
        for key in reversed(keys):  # freed tail first: the prefix is the most recently used
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        gone = 0
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
            gone += 1
        self.evicted.add(gone, now)
        return found

    def eviction_odds(self, now: float) -> float:
        """As ``BlockIndex.eviction_odds`` reads them from an upstream's events."""
        return eviction_odds(len(self.blocks), self.evicted.value(now))


def agents(conversations: list[list[str]]) -> list[int]:
    """Each conversation's agent, as ``trace`` names it first ("Agent 3 (run): ...")."""
    return [int(prompts[0].split(" ", 2)[1]) for prompts in conversations]


Router = Callable[[int, list[int], list[bytes], list[LruCache], float], int]


def hash_router(placement: int, groups: list[int]) -> Router:
    """Each agent on one upstream, drawn at random for this placement."""
    rng = random.Random(placement)
    home = [rng.randrange(UPSTREAMS) for _ in range(max(groups) + 1)]
    return lambda conversation, ids, keys, caches, now: home[groups[conversation]]


def packed_router(groups: list[int]) -> Router:
    """Each agent's conversations where a packing by popularity puts them."""
    sizes = [groups.count(g) for g in range(max(groups) + 1)]
    fair = len(groups) / UPSTREAMS
    load = [0.0] * UPSTREAMS
    homes: list[list[int]] = [[] for _ in sizes]
    for group in sorted(range(len(sizes)), key=lambda g: -sizes[g]):
        parts = 2 if sizes[group] > fair else 1
        for upstream in sorted(range(UPSTREAMS), key=lambda u: load[u])[:parts]:
            homes[group].append(upstream)
            load[upstream] += sizes[group] / parts
    return lambda conversation, ids, keys, caches, now: homes[groups[conversation]][
        conversation % len(homes[groups[conversation]])
    ]


class PreciseRouter:
    """kvgate's precise cost (``PreciseScorer.choose`` without events: the caches read
    directly); a prefix no cache holds goes where the hash would put it."""

    def __init__(self, placement: int, groups: list[int]) -> None:
        self.demand = Demand()
        self.urls = [str(n) for n in range(UPSTREAMS)]
        self.fallback = hash_router(placement, groups)
        self.call_tokens = 0.0  # what a call computes, on average (decayed)

    def __call__(
        self,
        conversation: int,
        ids: list[int],
        keys: list[bytes],
        caches: list[LruCache],
        now: float,
    ) -> int:
        held = [cache.held(keys) * BLOCK for cache in caches]
        if any(held):
            holdings = [Holding(h, c.eviction_odds(now)) for h, c in zip(held, caches, strict=True)]
            available = [True] * UPSTREAMS
            crowding = self.demand.crowding(self.urls, available, now)
            loads = [Load(0)] * UPSTREAMS  # no queues in the model
            average = self.call_tokens or len(ids)
            pick = best(len(ids), holdings, loads, available, average, crowding)
        else:
            pick = self.fallback(conversation, ids, keys, caches, now)
        self.call_tokens = call_average(self.call_tokens, len(ids) - held[pick])
        self.demand.add(self.urls[pick], len(ids), now)
        return pick


def replay(
    args: argparse.Namespace, conversations: list[list[list[int]]], route: Router | None
) -> tuple[int, float]:
    """Prompt tokens computed over the trace (each conversation's calls' token ids), and the
    load CoV (prompt tokens per upstream); ``route`` None: one cache of all three's blocks."""
    capacity = args.vllm_kv_blocks
    if route is None:
        caches = [LruCache(capacity * UPSTREAMS)]
    else:
        caches = [LruCache(capacity) for _ in range(UPSTREAMS)]
    think = pauses(args)
    calls = [(start, n, 0) for n, start in enumerate(starts(args))]
    heapq.heapify(calls)
    computed, sent = 0, [0] * len(caches)
    while calls:
        now, n, turn = heapq.heappop(calls)
        ids = conversations[n][turn]
        keys = request_keys(ids, BLOCK, None, None)
        pick = 0 if route is None else route(n, ids, keys, caches, now)
        computed += len(ids) - caches[pick].serve(keys, now) * BLOCK
        sent[pick] += len(ids)
        if turn + 1 < len(conversations[n]):
            heapq.heappush(calls, (now + ANSWER_S + think[n][turn], n, turn + 1))
    return computed, cov(sent) if route is not None else 0.0


def run(args: argparse.Namespace) -> None:
    if args.upstreams != "vllm":
        raise SystemExit("the model's caches are vLLM's: --upstreams vllm --vllm-kv-blocks N")
    tokenizer = upstream_tokenizer(args)
    floor = floor_tokens(trace(args, PRECISE), BLOCK, tokenizer)
    print(
        f"\n{args.sessions} conversations x {args.turns} turns over {args.groups} shared prompts, "
        f"3 LRU caches of {args.vllm_kv_blocks} blocks ({args.vllm_kv_blocks * BLOCK:,} tokens) "
        f"each; the floor: {floor} prompt tokens computed\n"
    )
    print("| placement | hash | packed (CoV) | precise (CoV) | pooled |")
    print("| --- | --- | --- | --- | --- |")
    figures: dict[str, list[int]] = {"hash": [], "packed": [], "precise": [], "pooled": []}
    for placement in range(args.placements):
        prompts = trace(args, f"model #{placement + 1}")
        groups = agents(prompts)
        conversations = [[tokenizer.encode(p) for p in turns] for turns in prompts]
        hashed, _ = replay(args, conversations, hash_router(placement, groups))
        packed, packed_cov = replay(args, conversations, packed_router(groups))
        precise, spread = replay(args, conversations, PreciseRouter(placement, groups))
        pooled, _ = replay(args, conversations, None)
        for name, value in (
            ("hash", hashed),
            ("packed", packed),
            ("precise", precise),
            ("pooled", pooled),
        ):
            figures[name].append(value)
        print(
            f"| {placement + 1} | {hashed} | {packed} ({packed_cov:.3f}) | {precise} "
            f"({spread:.3f}) | {pooled} |"
        )
    median = {name: statistics.median(values) for name, values in figures.items()}
    print(
        "\nmedians over the floor: "
        + ", ".join(f"{name} {value / floor:.2f}x" for name, value in median.items())
        + "; over hash: "
        + ", ".join(f"{name} {median[name] / median['hash']:.2f}x" for name in list(median)[1:])
    )
