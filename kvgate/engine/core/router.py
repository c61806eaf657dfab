"""Prefix-aware replica routing that every process computes identically.

A prompt should go where its prefix is (or soon will be) cached, without letting one hot
prefix overload a replica. Every position here comes from sha256, never Python's `hash()`,
so any number of kvgate processes behind a load balancer make the same choice with no shared
state or gossip.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
from collections.abc import Sequence
from typing import Protocol

from kvgate.engine.errors import EngineUnavailable

KEY_BLOCKS = 8  # a prompt without cache_key is keyed on its first (up to) eight blocks
MAX_ORDERS = 1 << 16  # keys whose ring order is kept (a few MiB at most)


class Prefilling(Protocol):
    """Which replica is computing a block now (a dict will do, or a live view of the pool)."""

    def get(self, block_hash: bytes, default: int | None = None, /) -> int | None: ...


def _live(available: Sequence[bool]) -> list[int]:
    live = [r for r, ok in enumerate(available) if ok]
    if not live:
        raise EngineUnavailable(f"all {len(available)} replicas are stalled or failed")
    return live


def _position(*parts: bytes) -> int:
    """A point on the ring: the first 8 bytes of sha256 over length-prefixed parts."""
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(4, "little") + part)
    return int.from_bytes(digest.digest()[:8], "big")


class PrefixRouter:
    """(a) follow an in-flight prefill of the longest matching prefix, else (b) consistent
    hashing with bounded loads on the cache key or the first blocks, else (c) least loaded.

    Bounded loads (Mirrokni, Thorup, Zadimoghaddam 2018): a replica may take a request only
    while its load is below ceil(c * (total + 1) / live); walking the ring from the key's
    position, the first such replica wins. Keys keep their replica while it has room and move
    only when it is full or unavailable.
    """

    def __init__(
        self,
        num_replicas: int,
        load_factor: float = 1.25,
        virtual_nodes: int = 128,
        prefilling: Prefilling | None = None,
        names: Sequence[bytes] | None = None,
    ):
        """``prefilling`` maps a block hash to the replica computing it now (only its
        ``.get`` is used, so a live view of the block pool will do). ``names`` place each
        replica on the ring (default: its index): members named by address (upstreams) keep
        their points when others join or leave, so only the keys of those move."""
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if load_factor < 1.0:
            raise ValueError(f"load_factor must be >= 1.0, got {load_factor}")
        if virtual_nodes < 1:
            raise ValueError(f"virtual_nodes must be >= 1, got {virtual_nodes}")
        self.num_replicas = num_replicas
        self.load_factor = load_factor
        self.prefilling = prefilling
        if names is None:
            names = [r.to_bytes(4, "little") for r in range(num_replicas)]
        if len(names) != num_replicas or len(set(names)) != num_replicas:
            raise ValueError(f"names must be {num_replicas} distinct names, got {list(names)}")
        ring = sorted(
            (_position(b"replica", name, v.to_bytes(4, "little")), r)
            for r, name in enumerate(names)
            for v in range(virtual_nodes)
        )
        self._points = [point for point, _ in ring]
        self._owners = [owner for _, owner in ring]
        self._orders: dict[bytes, tuple[int, ...]] = {}  # preference(), memoised

    def preference(self, key: bytes) -> tuple[int, ...]:
        """Every replica once, in ring order clockwise from the key's position. Memoised (at
        most ``MAX_ORDERS`` keys, then forgotten all at once): a session's key, or a shared
        prefix's, recurs on every call, which paid a SHA-256 and a ring walk each time."""
        order = self._orders.get(key)
        if order is not None:
            return order
        start = bisect.bisect_left(self._points, _position(b"key", key))
        owners = len(self._owners)
        seen: dict[int, None] = {}
        for i in range(owners):
            seen.setdefault(self._owners[(start + i) % owners])
            if len(seen) == self.num_replicas:
                break
        if len(self._orders) >= MAX_ORDERS:
            self._orders.clear()
        order = self._orders[key] = tuple(seen)
        return order

    def load_bound(self, loads: Sequence[int], available: Sequence[bool]) -> int:
        """The most requests a live replica may hold after taking one more."""
        live = _live(available)
        total = sum(loads[r] for r in live)
        return math.ceil(self.load_factor * (total + 1) / len(live))

    def choose(
        self,
        block_hashes: Sequence[bytes],
        cache_key: str | None,
        num_prompt_tokens: int,
        loads: Sequence[int],
        available: Sequence[bool],
    ) -> int:
        """The replica for a prompt whose full blocks have these chained hashes.

        `loads` counts running + waiting requests per replica; `available[r]` is False for
        a stalled or failed replica. `num_prompt_tokens` is part of the callers' contract; the policy needs only the
        hashes (a prompt shorter than one block has none).
        """
        if len(loads) != self.num_replicas or len(available) != self.num_replicas:
            raise ValueError(
                f"loads and available need {self.num_replicas} entries, "
                f"got {len(loads)} and {len(available)}"
            )
        bound = self.load_bound(loads, available)

        def has_room(r: int) -> bool:
            return 0 <= r < self.num_replicas and available[r] and loads[r] < bound

        if self.prefilling is not None:
            for block_hash in reversed(block_hashes):
                replica = self.prefilling.get(block_hash)
                if replica is not None:
                    if has_room(replica):
                        return replica
                    break  # the longest match is full or gone: place by hashing instead

        if cache_key is not None:
            key = b"cache_key:" + cache_key.encode()
        elif block_hashes:
            key = b"blocks:" + block_hashes[min(len(block_hashes), KEY_BLOCKS) - 1]
        else:
            return min(_live(available), key=lambda r: (loads[r], r))
        # The least loaded live replica is always below the bound, so the walk finds one.
        return next(r for r in self.preference(key) if has_room(r))


class _BlindRouter:
    """Baselines for benchmarks: blind to prefixes and load, they only skip dead replicas."""

    def choose(
        self,
        block_hashes: Sequence[bytes],
        cache_key: str | None,
        num_prompt_tokens: int,
        loads: Sequence[int],
        available: Sequence[bool],
    ) -> int:
        return self._pick(_live(available))

    def _pick(self, live: list[int]) -> int:
        raise NotImplementedError


class RoundRobinRouter(_BlindRouter):
    def __init__(self) -> None:
        self._turn = itertools.count()

    def _pick(self, live: list[int]) -> int:
        return live[next(self._turn) % len(live)]


class RandomRouter(_BlindRouter):
    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)  # seeded so a benchmark run can be repeated

    def _pick(self, live: list[int]) -> int:
        return self._rng.choice(live)


ROUTING_POLICIES = ("prefix", "round_robin", "random")


def make_router(
    policy: str,
    num_replicas: int,
    seed: int = 0,
    load_factor: float = 1.25,
    prefilling: Prefilling | None = None,
    names: Sequence[bytes] | None = None,
) -> PrefixRouter | _BlindRouter:
    """The router for a policy name (`EngineConfig.routing`, `--routing`)."""
    if policy == "prefix":
        return PrefixRouter(num_replicas, load_factor, prefilling=prefilling, names=names)
    if policy == "round_robin":
        return RoundRobinRouter()
    if policy == "random":
        return RandomRouter(seed)
    raise ValueError(f"routing must be one of {ROUTING_POLICIES}, got {policy!r}")
