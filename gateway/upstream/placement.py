"""Balanced first placement of routing keys, shared through Redis (fleet mode, ``--redis-url``).

The hash alone spreads a few keys unevenly (12 sessions fell 1/6/5 over three upstreams). With
Redis, the first gateway to see a new routing key (a ``cache_key``, else the prompt's prefix
key) places it on the least-loaded healthy upstream and records it; every gateway and worker
follows the record, refreshing its TTL as it uses it. Load is what the placing gateway knows
(scraped running + waiting, its own in-flight calls) plus the keys every gateway placed there
in the last ``COUNT_S`` seconds (a Redis hash, so sessions that start together are spread
before any of them shows in a scrape). One Lua script reads the record, or places the key and
counts it, atomically: two gateways placing the same new key at once get the same answer,
and concurrent new keys see each other's counts. A record naming an upstream that is out or
gone is replaced — only if it still names that one, so every gateway replaces it alike.
Records are followed through a near cache of ``NEAR_S`` seconds: a busy key costs one Redis
call per process per ``NEAR_S``, not one per call.

Redis slow (past ``KVGATE_UPSTREAM_PLACEMENT_TIMEOUT_S``, 10 ms) or down: ``None`` — the hash
decides, as without Redis — and, once it failed (or was slow ``SLOW_IN_A_ROW`` times in a
row), Redis is not asked again for ``BACKOFF_S``. Hot keys still overflow: a record is
followed only while its upstream is not pressed (``Load.pressed``).
Keys share one hash tag, so the script runs on Redis Cluster too.
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
SLOW_IN_A_ROW = 3  # timeouts in a row that count as a failure (one is just that call's)
NEAR_S = 5.0  # a record read is followed without asking again this long
NEAR_MAX = 1 << 16
COUNT_S = 60  # placements count as load this long after the last one
PREFIX = "kvgate:{placement}:"
COUNTS = "kvgate:{placement}counts"

# KEYS: the record, the counts. ARGV: TTL, counts TTL, the URL a record may be replaced
# from ('' none), then URL, load pairs of the available upstreams. Returns the record's URL.
PLACE = """
local current = redis.call('GET', KEYS[1])
if current and current ~= ARGV[3] then
  redis.call('EXPIRE', KEYS[1], ARGV[1])
  return current
end
local best, least = nil, nil
for i = 4, #ARGV, 2 do
  local load = tonumber(ARGV[i + 1]) + (tonumber(redis.call('HGET', KEYS[2], ARGV[i])) or 0)
  if least == nil or load < least then best, least = ARGV[i], load end
end
redis.call('SET', KEYS[1], best, 'EX', ARGV[1])
redis.call('HINCRBY', KEYS[2], best, 1)
redis.call('EXPIRE', KEYS[2], ARGV[2])
return best
"""


class Placements:
    """Routing key → upstream URL records in Redis, with a near cache and a fallback."""

    def __init__(self, client: Any, timeout_s: float, ttl_s: int = TTL_S) -> None:
        self._client = client
        self._place = client.register_script(PLACE)
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._near: dict[bytes, tuple[str, float]] = {}
        self._down_until = 0.0
        self._failures = 0  # in a row

    async def connect(self) -> None:
        """Open a connection now, so the first call's read is not a connect (failures are
        left to the calls: they fall back to the hash)."""
        try:
            async with asyncio.timeout(CONNECT_S):
                await self._client.ping()
        except REDIS_FAILURES:
            pass

    def near(self, key: bytes) -> str | None:
        """The URL this process read for ``key`` in the last ``NEAR_S`` seconds."""
        found = self._near.get(key)
        return found[0] if found is not None and found[1] > time.monotonic() else None

    async def place(
        self, key: bytes, candidates: Sequence[tuple[str, int]], replacing: str = ""
    ) -> str | None:
        """The URL recorded for ``key`` (its TTL refreshed) — placed now on the least loaded
        of ``candidates`` (URL, load) when there is none, or it is ``replacing`` — or None
        when Redis cannot say."""
        if time.monotonic() < self._down_until or not candidates:
            return None
        args: list[Any] = [self.ttl_s, COUNT_S, replacing]
        for url, load in candidates:
            args += [url, load]
        try:
            async with asyncio.timeout(self.timeout_s):
                raw = await self._place(keys=[PREFIX + key.decode(), COUNTS], args=args)
        except REDIS_FAILURES as exc:
            self._failures += 1
            if isinstance(exc, TimeoutError) and self._failures < SLOW_IN_A_ROW:
                return None  # slow this once: this call goes by the hash
            if self._down_until == 0.0:
                log.warning("placement records: Redis failed (%r); the hash decides", exc)
            self._down_until = time.monotonic() + BACKOFF_S
            return None
        self._failures = 0
        url = raw.decode() if isinstance(raw, bytes) else str(raw)
        if len(self._near) >= NEAR_MAX:
            self._near.clear()
        self._near[key] = (url, time.monotonic() + NEAR_S)
        return url

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
    own: Upstream | None,
) -> Upstream | None:
    """The available upstream the record for ``key`` names (placed now if there is none, or
    it names one that is out or gone), or None: the hash decides. ``own`` is the hash's
    choice: it takes a new key unless another is less loaded, so a call that falls back to
    the hash (Redis slow) most often goes where the record says."""
    by_url = {u.url: u for u in upstreams}
    url = placements.near(key)
    recorded = by_url.get(url) if url is not None else None
    if recorded is not None and recorded.breaker.available():
        return recorded
    ordered = sorted(upstreams, key=lambda u: u is not own)  # ties go to the first
    live = [(u.url, load(u)) for u in ordered if u.breaker.available()]
    url = await placements.place(key, live, url or "")
    named = by_url.get(url) if url is not None else None
    if url is not None and (named is None or not named.breaker.available()):
        url = await placements.place(key, live, url)  # the record names one out or gone
    chosen = by_url.get(url) if url is not None else None
    return chosen if chosen is not None and chosen.breaker.available() else None
