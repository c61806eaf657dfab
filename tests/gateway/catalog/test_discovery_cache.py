"""The discovery cache in-process: keys, hits and misses, LRU bound, version fan-out."""

from __future__ import annotations

import asyncio

import pytest

from kvgate.gateway.app import make_discovery_cache
from kvgate.gateway.catalog.discovery_cache import (
    DiscoveryCache,
    NearCache,
    VersionFanout,
    catalog_key,
)


class CountingBuilder:
    """A `build` callable that records how often the cache had to serialize."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.calls = 0

    def __call__(self) -> bytes:
        self.calls += 1
        return self.body


def test_catalog_key_layout():
    assert catalog_key("v1", "tools/list", "p0") == "kvgate:catalog:v1:tools/list:p0"


def test_near_cache_evicts_least_recently_used():
    near = NearCache(2)
    near.put("a", b"1")
    near.put("b", b"2")
    assert near.get("a") == b"1"  # a is now the most recent
    near.put("c", b"3")
    assert near.get("b") is None and near.get("a") == b"1" and near.get("c") == b"3"
    assert len(near) == 2


async def test_local_get_or_build_builds_once_per_key():
    events: list[str] = []
    cache = make_discovery_cache(None, on_event=events.append)
    assert type(cache) is DiscoveryCache
    await cache.start()
    build = CountingBuilder(b'{"tools":[]}')
    for _ in range(3):
        assert await cache.get_or_build("v1", "tools/list", "p0", build) == b'{"tools":[]}'
    assert build.calls == 1
    await cache.get_or_build("v2", "tools/list", "p0", build)
    await cache.get_or_build("v1", "tools/list", "p1", build)
    assert build.calls == 3
    stats = cache.stats
    assert (stats["hits"], stats["misses"], stats["degraded"]) == (2, 3, False)
    assert events.count("near_hit") == 2 and events.count("miss") == 3
    await cache.close()


async def test_local_versions_reach_every_subscriber_in_order():
    cache = make_discovery_cache(None)
    await cache.start()
    assert await cache.current_version() is None
    first, second = cache.versions(), cache.versions()
    await cache.publish_version("v1")
    await cache.publish_version("v1")  # repeated: not a change
    await cache.publish_version("v2")
    assert await cache.current_version() == "v2"
    await cache.close()
    assert [v async for v in first] == ["v1", "v2"]
    assert [v async for v in second] == ["v1", "v2"]
    assert cache.stats["versions_announced"] == 2


async def test_slow_subscriber_keeps_the_newest_versions():
    fanout = VersionFanout(queue_size=3)
    versions = fanout.subscribe()
    for n in range(10):
        fanout.announce(f"v{n}")
    fanout.close()
    received = [v async for v in versions]
    assert received[-1] == "v9" and len(received) <= 3
    assert len(fanout) == 0  # the finished iteration unsubscribed itself


async def test_cancelled_listener_unsubscribes():
    fanout = VersionFanout()
    versions = fanout.subscribe()

    async def listen() -> None:
        async for _ in versions:
            pass

    task = asyncio.create_task(listen())
    await asyncio.sleep(0)
    assert len(fanout) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(fanout) == 0


async def test_a_failing_build_propagates_and_caches_nothing():
    cache = make_discovery_cache(None)

    def unknown_resource() -> bytes:
        raise LookupError("Resource not found")

    with pytest.raises(LookupError):
        await cache.get_or_build("v1", "resources/read", "p0", unknown_resource)
    assert await cache.get_or_build("v1", "resources/read", "p0", lambda: b"{}") == b"{}"
    assert cache.stats["misses"] == 2 and cache.stats["near_cache_entries"] == 1
