"""Balanced first placement of routing keys, shared through Redis (fleet mode, ``--redis-url``).

The hash alone spreads a few keys unevenly (12 sessions fell 1/6/5 over three upstreams). With
Redis, the first gateway to see a new routing key (a ``cache_key``, else the prompt's prefix
key) places it on the least-loaded healthy upstream — scraped running + waiting, this
process's in-flight calls, and the keys every gateway placed there in the last ``COUNT_S``
seconds (a Redis hash: sessions that start together are spread before any of them shows in
a scrape) — and records it (``SET NX`` with a TTL); every gateway and worker follows the record, refreshing its TTL as
it uses it (``GETEX``). A record naming an upstream that is out (breaker open) or gone is
replaced by a new placement. Records are read through a near cache of ``NEAR_S`` seconds, so
a busy key costs one Redis call per process per ``NEAR_S``, not one per call.

Redis slow (past ``KVGATE_UPSTREAM_PLACEMENT_TIMEOUT_S``, 10 ms) or down: ``None`` — the hash
decides, as without Redis — and Redis is not asked again for ``BACKOFF_S``. Hot keys still overflow: a record is followed
only while its upstream is not pressed (``routing.Load.pressed``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import RedisError

from engine.router import KEY_BLOCKS
from gateway.upstream.upstream import Upstream

log = logging.getLogger("kvgate.fleet")
REDIS_FAILURES = (RedisError, OSError, TimeoutError)
TTL_S = 900  # a record unused this long is gone (the upstream's prefix cache is, by then)
CONNECT_S = 1.0  # at startup: the connection is made before calls wait on it
BACKOFF_S = 1.0  # after a failure, Redis is left alone this long
NEAR_S = 1.0  # a record read is followed without asking again this long
NEAR_MAX = 1 << 16
COUNT_S = 60  # placements count as load this long after the last one
PREFIX = b"kvgate:placement:"
COUNTS = b"kvgate:placements"


class Placements:
    """Routing key → upstream URL records in Redis, with a near cache and a fallback."""

    def __init__(self, client: Any, timeout_s: float, ttl_s: int = TTL_S) -> None:
        self._client = client
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._near: dict[bytes, tuple[str, float]] = {}
        self._down_until = 0.0

    async def connect(self) -> None:
        """Open a connection now, so the first call's read is not a connect (failures are
        left to the calls: they fall back to the hash)."""
        try:
            async with asyncio.timeout(CONNECT_S):
                await self._client.ping()
        except REDIS_FAILURES:
            pass

    async def counts(self) -> dict[str, int] | None:
        """Keys placed per upstream URL lately (by every gateway), or None (Redis failed)."""
        raw = await self._ask(self._client.hgetall, COUNTS)
        if raw is None:
            return None
        return {url.decode(): int(count) for url, count in raw.items()}

    async def recorded(self, key: bytes) -> str | None:
        """The URL recorded for ``key`` ('' when none is), or None when Redis cannot say."""
        now = time.monotonic()
        near = self._near.get(key)
        if near is not None and near[1] > now:
            return near[0]
        raw = await self._ask(self._client.getex, PREFIX + key, ex=self.ttl_s)
        if raw is None and self._down_until > now:
            return None
        url = raw.decode() if isinstance(raw, bytes) else ""
        if url:
            self._remember(key, url, now)
        return url

    async def place(self, key: bytes, url: str, replace: bool = False) -> str | None:
        """Record ``url`` for ``key`` (over any record when ``replace``, else only if there is
        none); the URL that stands, or None when Redis cannot say."""
        now = time.monotonic()
        name = PREFIX + key
        if replace:
            done = await self._ask(self._client.set, name, url, ex=self.ttl_s)
            standing = url if done else None
        else:
            raw = await self._ask(self._client.set, name, url, nx=True, ex=self.ttl_s, get=True)
            if self._down_until > now:
                return None
            standing = raw.decode() if isinstance(raw, bytes) else url
        if standing is not None:
            self._remember(key, standing, now)
        if standing == url:
            pipe = self._client.pipeline(transaction=False)
            pipe.hincrby(COUNTS, url, 1).expire(COUNTS, COUNT_S)
            await self._ask(pipe.execute)
        return standing

    async def _ask(self, command: Any, *args: Any, **options: Any) -> Any:
        """One Redis command within ``timeout_s``; None (and a pause) when it fails."""
        if time.monotonic() < self._down_until:
            return None
        try:
            async with asyncio.timeout(self.timeout_s):
                return await command(*args, **options)
        except REDIS_FAILURES as exc:
            if self._down_until == 0.0:
                log.warning("placement records: Redis failed (%s); the hash decides", exc)
            self._down_until = time.monotonic() + BACKOFF_S
            return None

    def _remember(self, key: bytes, url: str, now: float) -> None:
        if len(self._near) >= NEAR_MAX:
            self._near.clear()
        self._near[key] = (url, now + NEAR_S)

    async def aclose(self) -> None:
        await self._client.aclose()


def placement_key(hashes: Sequence[bytes], cache_key: str | None) -> bytes | None:
    """The key a call is placed by: the one the prefix router hashes (``engine.router``)."""
    if cache_key is not None:
        return b"cache_key:" + cache_key.encode()
    if hashes:
        return b"blocks:" + hashes[min(len(hashes), KEY_BLOCKS) - 1].hex().encode()
    return None


async def follow_or_place(
    placements: Placements,
    key: bytes,
    upstreams: Sequence[Upstream],
    load: Callable[[Upstream], int],
) -> Upstream | None:
    """The upstream the record for ``key`` names — placed now on the least-loaded available
    one if there is none, or if it names one that is out or gone — or None: the hash
    decides (Redis cannot say, or nothing is available)."""
    url = await placements.recorded(key)
    if url is None:
        return None
    by_url = {u.url: u for u in upstreams}
    recorded = by_url.get(url)
    if recorded is not None and recorded.breaker.available():
        return recorded
    counts = await placements.counts()
    live = [u for u in upstreams if u.breaker.available()]
    if counts is None or not live:
        return None
    pick = min(live, key=lambda u: (load(u) + counts.get(u.url, 0), u.index))
    standing = await placements.place(key, pick.url, replace=bool(url))
    chosen = by_url.get(standing) if standing else None
    return chosen if chosen is not None and chosen.breaker.available() else None
