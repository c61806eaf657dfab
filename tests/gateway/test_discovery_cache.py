"""The discovery cache in-process: keys, hits and misses, LRU bound, version fan-out."""

from __future__ import annotations

import asyncio

import pytest

from gateway.discovery_cache import (
    DiscoveryCache,
    NearCache,
    VersionFanout,
    catalog_key,
    make_discovery_cache,
    params_hash,
)


class CountingBuilder:
    """A `build` callable that records how often the cache had to serialize."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.calls = 0

    def __call__(self) -> bytes:
        self.calls += 1
        return self.body


def test_catalog_key_layout_and_private_scope():
    assert catalog_key("v1", "tools/list", "p0") == "kvgate:catalog:v1:tools/list:p0"
    alice = catalog_key("v1", "resources/read", "p0", scope_key="alice")
    bob = catalog_key("v1", "resources/read", "p0", scope_key="bob")
    assert alice.startswith("kvgate:catalog:v1:resources/read:p0:private:")
    assert alice != bob and "alice" not in alice


def test_params_hash_ignores_meta_and_key_order():
    meta = {"io.modelcontextprotocol/protocolVersion": "2026-07-28"}
    assert params_hash({"cursor": "c1", "_meta": meta}) == params_hash({"cursor": "c1"})
    assert params_hash({"a": 1, "b": 2}) == params_hash({"b": 2, "a": 1})
    assert params_hash(None) == params_hash({}) == params_hash({"_meta": meta})
    assert params_hash({"cursor": "c1"}) != params_hash({"cursor": "c2"})
    assert len(params_hash({"uri": "kvgate://models"})) == 32


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
    await cache.get_or_build("v1", "tools/list", "p0", build, scope_key="alice")
    assert build.calls == 4
    stats = cache.stats
    assert (stats["hits"], stats["misses"], stats["degraded"]) == (2, 4, False)
    assert events.count("near_hit") == 2 and events.count("miss") == 4
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
