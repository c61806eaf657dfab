"""Discovery cache shared through Redis by every kvgate process, and never a reason to fail.

Layout in Redis::

    kvgate:catalog:{version}:{method}:{params-hash}   entry, with TTL:
        b"kvgate-entry/1 {version}\n" + the serialized result
    kvgate:catalog:version                              current version
    kvgate:catalog:events   (pub/sub channel)           announced versions

The catalog is the same for every caller: no entry belongs to a tenant.

Every Redis call on a request's path is bounded by `timeout_s` (socket, connect and an outer
`wait_for`), with redis-py's own retries off. The first failure marks the cache *degraded*:
from then on requests skip Redis entirely (served from the near-cache, or built locally) and a
supervisor task probes Redis with backoff. When it answers again the supervisor re-subscribes
to the events channel, writes any version published during the outage, picks up the version
others published meanwhile, and clears the flag. One log line per outage, one on recovery.

Redis is not trusted: entries and the version are read bounded and typed
(`redis_records.RecordReader`: another type or an oversized value reads as none, and a hash
under an entry's key is a miss, not an outage); an entry whose envelope claims another
version, or whose result does not parse as one (`entry_problem`), is never served or kept
near but rebuilt; a version (key or pub/sub message) that is not a short printable token is
ignored. Both are counted and logged once. The supervisor survives anything: an unexpected error restarts it with backoff, counted
as "listener_restart" (`kvgate_discovery_cache_events_total{event="listener_restart"}`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.asyncio.client import PubSub
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kvgate.gateway.catalog.discovery_cache import KEY_PREFIX, DiscoveryCache
from kvgate.gateway.redis_connection import connect, stop_tasks
from kvgate.gateway.redis_records import RecordReader

VERSION_KEY = f"{KEY_PREFIX}:version"
EVENTS_CHANNEL = f"{KEY_PREFIX}:events"
REDIS_FAILURES = (RedisError, OSError, asyncio.TimeoutError)
LISTEN_POLL_S = 0.1  # how often the listener notices trouble reported by a request
HEALTH_PING_S = 1.0  # a quiet but hung Redis is noticed within this, even with no requests
ENTRY_MAGIC = b"kvgate-entry/1 "
MAX_VERSION_BYTES = 128
VERSION_TOKEN = re.compile(rb"[A-Za-z0-9._:-]{1,%d}" % MAX_VERSION_BYTES)  # ours: 16 hex digits

log = logging.getLogger(__name__)
T = TypeVar("T")


class RedisDiscoveryCache(DiscoveryCache):
    """`DiscoveryCache` whose entries and versions are shared through one Redis."""

    def __init__(
        self,
        redis_url: str,
        *,
        backoff_s: tuple[float, float] = (0.05, 2.0),
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self._redis = connect(
            redis_url,
            socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._records = RecordReader(self._redis)
        self._backoff_min, self._backoff_max = backoff_s
        self._up = False
        self._outage_since: float | None = None
        self._pending_version: str | None = None
        self._trouble = asyncio.Event()
        self._settled = asyncio.Event()
        self._supervisor: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect and subscribe in the background; wait briefly for the first attempt."""
        self._supervisor = asyncio.create_task(self._supervise(), name="kvgate-discovery-redis")
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._settled.wait(), timeout=10 * self.timeout_s)

    async def close(self) -> None:
        if self._supervisor is not None:
            await stop_tasks({self._supervisor})
        with contextlib.suppress(*REDIS_FAILURES):
            await asyncio.wait_for(self._redis.aclose(), timeout=self.timeout_s)
        await super().close()

    @property
    def degraded(self) -> bool:
        return not self._up

    async def current_version(self) -> str | None:
        """The version in Redis when it answers in time, else the latest heard of here."""
        current = await self._try(self._records.raw, VERSION_KEY, MAX_VERSION_BYTES)
        if current is not None:
            self._announce_raw(current)
        return await super().current_version()

    # --- the request path: bounded, and skipped while degraded ---

    async def _shared_get(self, key: str) -> bytes | None:
        if not self._up:
            self._count("degraded_requests", "degraded")
            return None
        stored = await self._try(self._records.raw, key)
        return None if stored is None else self._unwrap(key, stored)

    async def _shared_set(self, key: str, body: bytes) -> None:
        await self._try(self._redis.set, key, self._wrap(key, body), px=int(self.ttl_s * 1000))

    @staticmethod
    def _wrap(key: str, body: bytes) -> bytes:
        return ENTRY_MAGIC + _key_version(key).encode() + b"\n" + body

    def _unwrap(self, key: str, stored: Any) -> bytes | None:
        """The result inside an entry that claims ``key``'s version, else None (counted)."""
        expected = ENTRY_MAGIC + _key_version(key).encode() + b"\n"
        if isinstance(stored, bytes) and stored.startswith(expected):
            return stored[len(expected) :]
        self._count("bad_entries", "bad_entry")
        self._log_once(
            "bad_entry", "unusable discovery entry %s in Redis (wrong envelope): rebuilt", key
        )
        return None

    async def _shared_publish(self, version: str) -> None:
        self._pending_version = version
        if await self._try(self._write_version, version) is not None:
            self._pending_version = None

    async def _try(self, call: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T | None:
        """`call(...)` within `timeout_s`; None when degraded, or when Redis fails or is slow."""
        if not self._up:
            return None
        try:
            return await asyncio.wait_for(call(*args, **kwargs), self.timeout_s)
        except REDIS_FAILURES as exc:
            self._mark_down(exc)
            return None

    async def _write_version(self, version: str) -> list[Any]:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(VERSION_KEY, version)
            pipe.publish(EVENTS_CHANNEL, version)
            written: list[Any] = await pipe.execute()
            return written

    # --- the supervisor: (re)connect, re-subscribe, listen, probe ---

    async def _supervise(self) -> None:
        """`_connect_and_listen` forever; whatever it raises, it is restarted with backoff."""
        backoff = self._backoff_min
        while True:
            try:
                await self._connect_and_listen()  # returns only by raising
            except Exception as exc:  # a bug or input nobody foresaw must not end the listener
                if self._up:  # it worked since the last failure: start the backoff over
                    backoff = self._backoff_min
                self._count("listener_restarts", "listener_restart")
                self._log_once("listener", "redis listener failed (%r); restarting it", exc)
                self._mark_down(exc)
                await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
                backoff = min(2 * backoff, self._backoff_max)

    async def _connect_and_listen(self) -> None:
        """(Re)connect with backoff whenever Redis fails, listening while it answers."""
        backoff = self._backoff_min
        while True:
            self._trouble.clear()
            pubsub = self._redis.pubsub()
            try:
                await self._bounded(pubsub.subscribe(EVENTS_CHANNEL))
                await self._resync()
                self._mark_up()
                backoff = self._backoff_min
                await self._listen(pubsub)
            except REDIS_FAILURES as exc:
                self._mark_down(exc)
            finally:
                with contextlib.suppress(*REDIS_FAILURES):
                    await self._bounded(pubsub.aclose())
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(2 * backoff, self._backoff_max)

    async def _resync(self) -> None:
        """After (re)connecting: push a version published while down, adopt Redis's, or
        restore ours quietly if Redis came back empty (a restart is not a catalog change)."""
        await self._bounded(self._redis.ping())
        if (pending := self._pending_version) is not None:
            await self._bounded(self._write_version(pending))
            if self._pending_version == pending:
                self._pending_version = None
        current = await self._bounded(self._records.raw(VERSION_KEY, MAX_VERSION_BYTES))
        if current is not None:
            self._announce_raw(current)
        elif (latest := self._fanout.latest) is not None:
            await self._bounded(self._redis.set(VERSION_KEY, latest, nx=True))

    async def _listen(self, pubsub: PubSub) -> None:
        """Announce each published version until Redis fails or a request reports trouble."""
        loop = asyncio.get_running_loop()
        next_ping = loop.time() + HEALTH_PING_S
        while not self._trouble.is_set():
            message = await pubsub.get_message(
                ignore_subscribe_messages=True, timeout=LISTEN_POLL_S
            )
            if message is not None and message.get("type") == "message":
                self._announce_raw(message.get("data"))
            if loop.time() >= next_ping:
                await self._bounded(self._redis.ping())
                next_ping = loop.time() + HEALTH_PING_S

    async def _bounded(self, call: Awaitable[T]) -> T:
        return await asyncio.wait_for(call, self.timeout_s)

    def _announce_raw(self, raw: Any) -> None:
        """Announce a version read from Redis, if it is one (else count it and move on)."""
        if isinstance(raw, bytes) and VERSION_TOKEN.fullmatch(raw):
            self._announce(raw.decode("ascii"))
            return
        self._count("bad_versions", "bad_version")
        self._log_once(
            "bad_version",
            "ignored an unusable catalog version from Redis: %r",
            raw[:64] if isinstance(raw, bytes) else raw,
        )

    # --- state changes, each logged once ---

    def _mark_down(self, exc: BaseException) -> None:
        self._up = False
        self._trouble.set()
        self._settled.set()
        self._count("redis_errors", "redis_error")
        if self._outage_since is None:
            self._outage_since = time.monotonic()
            self._count("outages", "outage")
            log.warning(
                "redis unavailable (%s: %s); serving discovery from the local cache",
                type(exc).__name__,
                exc,
            )

    def _mark_up(self) -> None:
        self._up = True
        self._settled.set()
        if self._outage_since is not None:
            log.warning(
                "redis reachable again after %.1f s; discovery cache shared again",
                time.monotonic() - self._outage_since,
            )
            self._outage_since = None
            self._count("recoveries", "recovered")


def _key_version(key: str) -> str:
    """``kvgate:catalog:{version}:...`` → the version."""
    return key[len(KEY_PREFIX) + 1 :].split(":", 1)[0]
