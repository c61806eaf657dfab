"""Discovery cache: serialized catalog results, shared per catalog version.

The catalog (`server/discover`, the `*/list` results, static `resources/read`) is the same for
every caller and changes only when the loaded models or config change, so each result is
serialized once per catalog *version* (a content hash) and kept here::

    get_or_build(version, method, params_hash, build)
        │ near-cache (bounded LRU, this process)  ── hit → bytes
        │ shared store (Redis, `RedisDiscoveryCache`) ── hit → bytes, kept near
        └ build() locally ── stored near and shared

Nothing read from the shared store is trusted: an entry is served (and kept near) only if it
parses as the JSON object of a complete result of its method (`entry_problem`); anything else
is counted ("bad_entry"), logged once, and rebuilt locally, which also overwrites it.

Because a key names its version, an entry never goes stale: a new catalog gets new keys and
old ones simply age out (LRU here, TTL in Redis). Catalog changes are *announced* with
`publish_version`; every process (every `versions()` subscriber) hears each new version once,
which is what `subscriptions/listen` turns into `notifications/*/list_changed`.

This module is the in-process cache (no Redis: one process, same interface);
`kvgate.gateway.catalog.redis_cache` adds the shared store; the app picks one at startup.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson

KEY_PREFIX = "kvgate:catalog"
SUBSCRIBER_QUEUE_SIZE = 16
LIST_KEYS = {  # the list each catalog method's result carries
    "tools/list": "tools",
    "resources/list": "resources",
    "resources/templates/list": "resourceTemplates",
    "prompts/list": "prompts",
    "resources/read": "contents",
}

log = logging.getLogger(__name__)

EventHook = Callable[[str], None]
"""Called with an event name, for metrics: "near_hit", "shared_hit", "miss", "redis_error",
"degraded" (Redis skipped during an outage), "outage", "recovered", "version", "bad_entry"
(an unusable entry from Redis, rebuilt), "bad_version" (an unusable version string from Redis,
ignored), "listener_restart" (the Redis background task failed and was restarted). Must not
raise."""


def entry_problem(body: bytes, method: str) -> str | None:
    """Why ``body`` (from the shared store) cannot be served as ``method``'s result, or None.

    It must be UTF-8 JSON (orjson rejects invalid UTF-8), an object saying ``resultType:
    "complete"``, and carry its method's list (``server/discover`` has no fixed list)."""
    try:
        result: Any = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return f"not JSON ({exc})"
    if not isinstance(result, dict):
        return "not a JSON object"
    if result.get("resultType") != "complete":
        return "no resultType 'complete'"
    key = LIST_KEYS.get(method)
    if key is not None and not isinstance(result.get(key), list):
        return f"no {key!r} list"
    return None


def catalog_key(version: str, method: str, params_hash: str) -> str:
    """`kvgate:catalog:{version}:{method}:{params-hash}`."""
    return f"{KEY_PREFIX}:{version}:{method}:{params_hash}"


class NearCache:
    """A bounded LRU of serialized results: the per-process layer in front of Redis."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, bytes] = OrderedDict()

    def get(self, key: str) -> bytes | None:
        body = self._entries.get(key)
        if body is not None:
            self._entries.move_to_end(key)
        return body

    def put(self, key: str, body: bytes) -> None:
        self._entries[key] = body
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


class VersionFanout:
    """Delivers each newly announced version to every subscriber's own bounded queue.

    A slow subscriber loses its *oldest* pending versions, never the newest: a listener only
    needs to know that the catalog changed and what it is now.
    """

    def __init__(self, queue_size: int = SUBSCRIBER_QUEUE_SIZE) -> None:
        self._queue_size = queue_size
        self._queues: set[asyncio.Queue[str | None]] = set()
        self.latest: str | None = None

    def announce(self, version: str) -> bool:
        """Record `version`; deliver it if it differs from the latest. True when delivered."""
        if version == self.latest:
            return False
        self.latest = version
        for queue in self._queues:
            _put_dropping_oldest(queue, version)
        return True

    def subscribe(self) -> AsyncIterator[str]:
        """Register now (so nothing announced after this call is missed), iterate later."""
        queue: asyncio.Queue[str | None] = asyncio.Queue(self._queue_size)
        self._queues.add(queue)
        return self._drain(queue)

    def close(self) -> None:
        """End every subscriber's iteration."""
        for queue in self._queues:
            _put_dropping_oldest(queue, None)

    async def _drain(self, queue: asyncio.Queue[str | None]) -> AsyncIterator[str]:
        try:
            while (version := await queue.get()) is not None:
                yield version
        finally:
            self._queues.discard(queue)

    def __len__(self) -> int:
        return len(self._queues)


def _put_dropping_oldest(queue: asyncio.Queue[str | None], item: str | None) -> None:
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(item)


class DiscoveryCache:
    """The in-process discovery cache; also the base of the Redis-backed one.

    Subclasses share entries and versions through `_shared_get`, `_shared_set` and
    `_shared_publish`, which here do nothing.
    """

    def __init__(
        self,
        *,
        near_cache_size: int = 256,
        ttl_s: float = 300,
        timeout_s: float = 0.05,
        on_event: EventHook | None = None,
    ) -> None:
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self._near = NearCache(near_cache_size)
        self._fanout = VersionFanout()
        self._on_event = on_event
        self._logged: set[str] = set()  # what was already logged once
        self._counts = dict.fromkeys(
            (
                "near_hits",
                "shared_hits",
                "misses",
                "redis_errors",
                "degraded_requests",
                "outages",
                "recoveries",
                "versions_announced",
                "bad_entries",
                "bad_versions",
                "listener_restarts",
            ),
            0,
        )

    async def start(self) -> None:
        """Nothing to connect in-process."""

    async def close(self) -> None:
        """End every `versions()` iteration."""
        self._fanout.close()

    async def get_or_build(
        self,
        version: str,
        method: str,
        params_hash: str,
        build: Callable[[], bytes],
    ) -> bytes:
        """The serialized `result` for (version, method, params); `build()` only on a miss.

        `build` serializes the result from this process's own catalog; it is used on a miss,
        and whenever Redis cannot answer in time. If it raises (say, an unknown resource), the
        error propagates and nothing is cached. Never raises
        because of Redis; waits at most `timeout_s` per Redis call (a hit makes one, a miss
        two, and none at all while Redis is known to be down).
        """
        key = catalog_key(version, method, params_hash)
        body = self._near.get(key)
        if body is not None:
            self._count("near_hits", "near_hit")
            return body
        body = await self._shared_get(key)
        if body is not None and (problem := entry_problem(body, method)) is not None:
            self._count("bad_entries", "bad_entry")
            self._log_once(
                "bad_entry", "unusable discovery entry %s in Redis (%s): rebuilt", key, problem
            )
            body = None
        if body is not None:
            self._count("shared_hits", "shared_hit")
        else:
            self._count("misses", "miss")
            body = build()
            await self._shared_set(key, body)
        self._near.put(key, body)
        return body

    async def publish_version(self, version: str) -> None:
        """Announce a new catalog version to this process's listeners and to every process."""
        self._announce(version)
        await self._shared_publish(version)

    def versions(self) -> AsyncIterator[str]:
        """Each newly announced version, in order, until `close()`.

        Subscribes at call time, so a version announced between this call and the first
        iteration is still delivered. Does not yield the current version (see
        `current_version`). Each subscriber has its own bounded queue.
        """
        return self._fanout.subscribe()

    async def current_version(self) -> str | None:
        """The latest announced catalog version, or None before any."""
        return self._fanout.latest

    @property
    def stats(self) -> dict[str, int | bool | str | None]:
        """Counters for metrics: hits = near + shared, misses = local builds."""
        return {
            **self._counts,
            "hits": self._counts["near_hits"] + self._counts["shared_hits"],
            "degraded": self.degraded,
            "near_cache_entries": len(self._near),
            "subscribers": len(self._fanout),
            "version": self._fanout.latest,
        }

    @property
    def degraded(self) -> bool:
        """True while the shared store is unreachable (never, in-process)."""
        return False

    def _announce(self, version: str) -> None:
        if self._fanout.announce(version):
            self._count("versions_announced", "version")

    def _log_once(self, kind: str, message: str, *args: Any) -> None:
        """A warning the first time ``kind`` happens in this process; the counters say the rest."""
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(message + " (further ones are only counted)", *args)

    def _count(self, counter: str, event: str) -> None:
        self._counts[counter] += 1
        if self._on_event is not None:
            self._on_event(event)

    async def _shared_get(self, key: str) -> bytes | None:
        return None

    async def _shared_set(self, key: str, body: bytes) -> None:
        return None

    async def _shared_publish(self, version: str) -> None:
        return None
