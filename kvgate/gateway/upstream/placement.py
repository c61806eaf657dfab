"""Balanced first placement of routing keys, shared through Redis (fleet mode, ``--redis-url``).

The hash alone spreads a few keys unevenly (12 sessions fell 1/6/5 over three upstreams). With
Redis, the first gateway to see a new routing key (a ``cache_key``, else the prompt's prefix
key) places it on the least-loaded healthy upstream and records it; every gateway and worker
follows the record, refreshing its TTL as it uses it. Load is the larger of what the placing
gateway knows (scraped running + waiting, its own in-flight calls) and the keys every gateway
placed there (a Redis hash, kept while placements come at least every ``COUNT_S`` seconds):
sessions that start together are spread before any of them shows in a scrape, and a new
session's first call, in flight, is not counted twice. One Lua script reads the record, or
places the key and counts it, atomically: two gateways placing the same new key at once get
the same answer, and concurrent new keys see each other's counts. A record naming an
upstream that is out or gone is replaced — only if it still names that one, so every
gateway replaces it alike.

A record must name where the key's calls went, or its session's cache is split between two
upstreams (on a busy machine, Redis answered the first turns of a 12-session burst after the
bound: each went by the hash while its script, run anyway, recorded another upstream, and the
later turns followed the record; other processes, reading the record late, went by the hash
too). So nothing here leaves a call's route to the timing of a Redis answer:

- A call waits at most ``KVGATE_UPSTREAM_PLACEMENT_TIMEOUT_S`` (50 ms) for Redis — none while
  an earlier read is already overdue — then goes by the hash; the answer is still read
  (never cancelled: a cancelled read also drops its connection), and a key its script placed
  elsewhere is moved to where the call went (``settle``), only if the record still names it.
- Every placement, move and replacement is published; every process keeps what it hears in a
  near cache and follows it with no Redis read in the call's path (a process seeing a session
  for the first time already knows where it went). An entry older than ``NEAR_S`` is still
  followed while one background read refreshes it (and the record's TTL).

So a call waits on Redis only for a key its process has not heard of (or one whose upstream
is out here). Redis down, or an answer not come within ``ANSWER_S``: Redis is left alone for
``BACKOFF_S`` and the hash decides, no call fails. Hot keys still overflow: a record is
followed only while its upstream is not pressed (``Load.pressed``). Keys share one hash tag,
so the scripts run on Redis Cluster too.

A record is read as every record kvgate reads back (``redis_records.BOUNDED_GET``, in the
scripts): one that is not a short printable string — another type, oversized, binary — is no
record, and is replaced; a URL heard or read is followed only if it names an upstream of this
fleet. A routing key is placed under the call's ``cache_salt`` (its tenant's, salted), so one
tenant's ``cache_key`` or prompt never reads, refreshes or moves another tenant's record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, NamedTuple, TypeAlias, TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from kvgate.engine.core.router import KEY_BLOCKS
from kvgate.gateway.redis_connection import stop_tasks
from kvgate.gateway.redis_records import BOUNDED_GET, key_part
from kvgate.gateway.upstream.upstream import Upstream

log = logging.getLogger("kvgate.fleet")
REDIS_FAILURES = (RedisError, OSError, TimeoutError)
TTL_S = 900  # a record unused this long is gone (the upstream's prefix cache is, by then)
CONNECT_S = 1.0  # at startup: the connections are made before calls wait on them
WARM_CONNECTIONS = 4  # opened at startup: a burst of new keys does not wait on connects
ANSWER_S = 1.0  # an answer not come by then is a failure (Redis stalled)
LATE_S = 10.0  # a failed read is still awaited this long: a script that ran must be settled
BACKOFF_S = 1.0  # after a failure, Redis is left alone this long
NEAR_S = 5.0  # a record heard is followed this long before a background read refreshes it
NEAR_MAX = 1 << 16
COUNT_S = 60  # placements count as load this long after the last one
PREFIX = "kvgate:{placement}:"
COUNTS = "kvgate:{placement}counts"
CHANNEL = "kvgate:{placement}heard"  # messages: URL, newline, key
MAX_URL_BYTES = 2048
URL = re.compile(rb"[!-~]{1,%d}" % MAX_URL_BYTES)  # what a record may hold: printable ASCII

# Both scripts: the counts are a hash, or are started again (another type would fail them).
COUNTS_HASH = """
if redis.call('TYPE', KEYS[2])['ok'] ~= 'hash' then redis.call('DEL', KEYS[2]) end
"""
# KEYS: the record, the counts. ARGV: TTL, counts TTL, the URL a record may be replaced
# from ('' none), the key, then URL, load pairs of the available upstreams.
# Returns {URL recorded, 1 if placed now else 0}.
PLACE = (
    BOUNDED_GET
    + COUNTS_HASH
    + f"""
local current = bounded_get(KEYS[1], {MAX_URL_BYTES})
if current and not string.find(current, '^[!-~]+$') then current = false end
if current and current ~= ARGV[3] then
  redis.call('EXPIRE', KEYS[1], ARGV[1])
  return {{current, 0}}
end
local best, least = nil, nil
for i = 5, #ARGV, 2 do
  local placed = tonumber(redis.call('HGET', KEYS[2], ARGV[i])) or 0
  local load = math.max(tonumber(ARGV[i + 1]), placed)
  if least == nil or load < least then best, least = ARGV[i], load end
end
redis.call('SET', KEYS[1], best, 'EX', ARGV[1])
redis.call('HINCRBY', KEYS[2], best, 1)
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('PUBLISH', '{CHANNEL}', best .. '\\n' .. ARGV[4])
return {{best, 1}}
"""
)
# KEYS: the record, the counts. ARGV: TTL, the URL placed, the URL the call went to, the key.
# Moves the record (and its count) only if it still names the URL placed; returns 1 if so.
MOVE = (
    BOUNDED_GET
    + COUNTS_HASH
    + f"""
if bounded_get(KEYS[1], {MAX_URL_BYTES}) ~= ARGV[2] then return 0 end
redis.call('SET', KEYS[1], ARGV[3], 'EX', ARGV[1])
redis.call('HINCRBY', KEYS[2], ARGV[2], -1)
redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
redis.call('PUBLISH', '{CHANNEL}', ARGV[3] .. '\\n' .. ARGV[4])
return 1
"""
)


class Answer(NamedTuple):
    url: str  # what the record names
    placed: bool  # by this very script run (not read)


Asked: TypeAlias = "asyncio.Task[Answer | None]"
T = TypeVar("T")


class Placements:
    """Routing key → upstream URL records in Redis, heard into a near cache."""

    def __init__(self, client: Any, timeout_s: float, ttl_s: int = TTL_S) -> None:
        self._client = client
        self._place = client.register_script(PLACE)
        self._move = client.register_script(MOVE)
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self._near: dict[bytes, tuple[str, float]] = {}  # key → (URL, when heard)
        self._refreshing: set[bytes] = set()
        self._asking: dict[asyncio.Task[Any], float] = {}  # reads in flight, since when
        self._down_until = 0.0
        self._tasks: set[asyncio.Task[Any]] = set()

    async def connect(self) -> None:
        """Load the scripts and open a few connections now, so the first calls' reads are
        neither connects nor script loads, and start listening (failures are left to the
        calls: they fall back to the hash)."""
        client = self._client
        try:
            async with asyncio.timeout(CONNECT_S):
                await asyncio.gather(
                    client.script_load(PLACE),
                    client.script_load(MOVE),
                    *(client.ping() for _ in range(WARM_CONNECTIONS - 2)),
                )
        except REDIS_FAILURES:
            pass
        self._spawn(self._listen())

    def near(self, key: bytes) -> tuple[str | None, bool]:
        """The URL this process last heard for ``key`` (None: none, or older than the TTL),
        and whether it is fresh (heard in the last ``NEAR_S`` seconds)."""
        found = self._near.get(key)
        if found is None:
            return None, False
        age = time.monotonic() - found[1]
        return (found[0], age < NEAR_S) if age < self.ttl_s else (None, False)

    def ask(
        self, key: bytes, candidates: Sequence[tuple[str, int]], replacing: str = ""
    ) -> Asked | None:
        """The record for ``key`` (its TTL refreshed), placed on the least loaded of
        ``candidates`` (URL, load) when there is none or it names ``replacing``: a task that
        is never cancelled by a caller giving up on it. None: Redis is not asked now."""
        if time.monotonic() < self._down_until or not candidates:
            return None
        args: list[Any] = [self.ttl_s, COUNT_S, replacing, key]
        for url, load in candidates:
            args += [url, load]
        asked = self._spawn(self._ask(key, args))
        self._asking[asked] = time.monotonic()
        asked.add_done_callback(self._asking.pop)
        return asked

    async def wait(self, asked: Asked) -> Answer | None:
        """``asked``'s answer if it comes within the bound, else None (it is still read).
        While an earlier read is overdue Redis is slow: no call waits on it."""
        now = time.monotonic()
        oldest = next(iter(self._asking.values()), now)  # reads are kept in the order sent
        if oldest < now - self.timeout_s:
            return None
        done, _ = await asyncio.wait((asked,), timeout=self.timeout_s)
        return asked.result() if done else None

    def refresh(self, key: bytes, candidates: Sequence[tuple[str, int]]) -> None:
        """Read ``key``'s record again in the background (one read at a time per key)."""
        if key in self._refreshing:
            return
        asked = self.ask(key, candidates)
        if asked is not None:
            self._refreshing.add(key)
            asked.add_done_callback(lambda _: self._refreshing.discard(key))

    def settle(self, key: bytes, asked: Asked, went: str) -> None:
        """A call went to ``went`` without waiting for ``asked``: when its script placed the
        key elsewhere, move the record to where the call went (its prefix is cached there)."""
        self._spawn(self._settle(key, asked, went))

    async def aclose(self) -> None:
        await stop_tasks(set(self._tasks))
        await self._client.aclose()

    def _spawn(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _run(
        self, script: Any, key: bytes, args: list[Any], bound_s: float = ANSWER_S
    ) -> Any:
        """``script`` on ``key``'s record and the counts, within ``bound_s``; once more on
        a connection error (a pooled connection that Redis closed, as a restart does)."""
        keys = [PREFIX + key.decode(), COUNTS]
        async with asyncio.timeout(bound_s):
            try:
                return await script(keys=keys, args=args)
            except RedisConnectionError:
                return await script(keys=keys, args=args)

    async def _ask(self, key: bytes, args: list[Any]) -> Answer | None:
        """The placing script's answer. One not come within ``ANSWER_S`` counts as a
        failure (Redis is left alone a while) but is still awaited up to ``LATE_S``: the
        script was sent and may have placed the key, and a call that went by the hash
        meanwhile must move that record to where it went (``settle``), or the conversation is
        split between two upstreams."""
        run = self._spawn(self._run(self._place, key, args, LATE_S))
        done, _ = await asyncio.wait((run,), timeout=ANSWER_S)
        if not done:
            self._failed(TimeoutError(f"no answer within {ANSWER_S} s"))
        try:
            raw = await run
        except REDIS_FAILURES as exc:
            if done:
                self._failed(exc)
            return None
        url = raw[0].decode() if isinstance(raw[0], bytes) else str(raw[0])
        self._heard(key, url)
        return Answer(url, bool(raw[1]))

    async def _settle(self, key: bytes, asked: Asked, went: str) -> None:
        answer = await asked
        if answer is None or not answer.placed or answer.url == went:
            return
        args = [self.ttl_s, answer.url, went, key]
        try:
            moved = await self._run(self._move, key, args, LATE_S)  # no call waits on it
        except REDIS_FAILURES as exc:
            self._failed(exc)
            return
        if moved:
            self._heard(key, went)

    async def _listen(self) -> None:
        """Hear every process's placements into the near cache, resubscribing after a
        failure (meanwhile near misses are read, or go by the hash)."""
        while True:
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(CHANNEL)
                async for message in pubsub.listen():
                    if message["type"] != "message":
                        continue
                    url, sep, key = message["data"].partition(b"\n")
                    if sep and URL.fullmatch(url):
                        self._heard(key, url.decode("ascii"))
            except REDIS_FAILURES:
                pass
            finally:
                with contextlib.suppress(*REDIS_FAILURES):
                    await pubsub.aclose()
            await asyncio.sleep(BACKOFF_S)

    def _heard(self, key: bytes, url: str) -> None:
        if len(self._near) >= NEAR_MAX and key not in self._near:
            self._near.clear()
        self._near[key] = (url, time.monotonic())

    def _failed(self, exc: BaseException) -> None:
        if time.monotonic() >= self._down_until + BACKOFF_S:  # once per outage
            log.warning("placement records: Redis failed (%r); the hash decides", exc)
        self._down_until = time.monotonic() + BACKOFF_S


def placement_key(
    hashes: Sequence[bytes], cache_key: str | None, cache_salt: str | None
) -> bytes | None:
    """The key a call is placed by: the one the prefix router hashes (``kvgate.engine.core.router``),
    under the call's ``cache_salt``: prefixes cached under different salts are different
    prefixes, and a tenant's salt is its own (``identity.tenant_salt``)."""
    salt = b"" if cache_salt is None else b"salt:" + key_part(cache_salt).encode() + b":"
    if cache_key is not None:
        return salt + b"cache_key:" + cache_key.encode()
    if hashes:
        return salt + b"blocks:" + hashes[min(len(hashes), KEY_BLOCKS) - 1].hex().encode()
    return None


async def follow_or_place(
    placements: Placements,
    key: bytes,
    upstreams: Sequence[Upstream],
    load: Callable[[Upstream], int],
    own: Upstream | None,
) -> tuple[Upstream | None, Asked | None]:
    """The available upstream the record for ``key`` names (placed now if there is none, or
    it names one that is out or gone), or None: the hash decides; and the Redis read the
    call did not wait for (to ``settle`` once the call has gone somewhere). ``own`` is the
    hash's choice: it takes a new key unless another is less loaded."""
    by_url = {u.url: u for u in upstreams}
    url, fresh = placements.near(key)
    recorded = by_url.get(url) if url is not None else None
    if recorded is not None and recorded.breaker.available() and fresh:
        return recorded, None  # the common case: no Redis, no load figures
    ordered = sorted(upstreams, key=lambda u: u is not own)  # ties go to the first
    live = [(u.url, load(u)) for u in ordered if u.breaker.available()]
    if recorded is not None and recorded.breaker.available():
        placements.refresh(key, live)
        return recorded, None
    for _ in range(2):  # a second time when the record names one out or gone here
        asked = placements.ask(key, live, url or "")
        if asked is None:
            return None, None
        answer = await placements.wait(asked)
        if answer is None:
            return None, asked
        url = answer.url
        named = by_url.get(url)
        if named is not None and named.breaker.available():
            return named, None
    return None, None
