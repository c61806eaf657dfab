"""The discovery cache shared through a real, private redis-server that the tests kill and pause.

No mocks: every test talks to its own `redis-server` (see `redis_fixtures`). Loops are bounded
by iteration counts and deadlines, so a broken cache fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import orjson
import pytest
import redis.asyncio as aioredis

from kvgate.gateway.app import make_discovery_cache
from kvgate.gateway.catalog.discovery_cache import catalog_key
from kvgate.gateway.catalog.redis_cache import EVENTS_CHANNEL, VERSION_KEY, RedisDiscoveryCache
from tests.gateway.live_server import LiveServer, free_port
from tests.gateway.redis_fixtures import RedisServer, requires_redis_server
from tests.gateway.wire import call, modern_headers, modern_meta

pytestmark = [pytest.mark.redis, requires_redis_server]
REPO_ROOT = Path(__file__).resolve().parents[3]
GENEROUS_TIMEOUT_S = 0.5  # for tests about sharing, not speed: a busy CI box must not degrade


@pytest.fixture
def redis_server(tmp_path):
    with RedisServer(tmp_path) as server:
        yield server


@pytest.fixture
async def raw_redis(redis_server):
    client = aioredis.from_url(redis_server.url)
    yield client
    await client.aclose()


async def started(url: str, **options) -> RedisDiscoveryCache:
    cache = RedisDiscoveryCache(url, **options)
    await cache.start()
    return cache


def result(tag: str | int, key: str = "tools") -> bytes:
    """A serialized result of the shape a catalog method returns (what the cache accepts)."""
    return orjson.dumps({"resultType": "complete", key: [{"name": str(tag)}]})


POISON = (  # what a broken or hostile writer could leave under an entry's key
    b"kvgate-entry/1 v1\n{not json",
    b"kvgate-entry/1 v1\n\xff\xfe" + result("x")[2:],  # invalid UTF-8
    b'kvgate-entry/1 v1\n{"tools":[]}',  # no resultType
    b'kvgate-entry/1 v1\n{"resultType":"complete"}',  # no tools list
    b'kvgate-entry/1 v1\n["resultType","complete"]',  # not an object
    b"kvgate-entry/1 v2\n" + result("other version"),  # claims another version
    result("no envelope"),
    b"",
)


def must_not_build() -> bytes:
    raise AssertionError("the entry should have come from Redis")


async def next_version(versions, within_s: float = 1.0) -> str:
    return await asyncio.wait_for(anext(versions), timeout=within_s)


async def wait_until(condition, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


async def test_two_caches_share_entries_with_ttl(redis_server, raw_redis):
    first = make_discovery_cache(redis_server.url, timeout_s=GENEROUS_TIMEOUT_S, ttl_s=60)
    assert isinstance(first, RedisDiscoveryCache)
    await first.start()
    second = await started(redis_server.url, timeout_s=GENEROUS_TIMEOUT_S, ttl_s=60)
    body = result("generate")
    assert await first.get_or_build("v1", "tools/list", "p0", lambda: body) == body
    assert await second.get_or_build("v1", "tools/list", "p0", must_not_build) == body
    assert await second.get_or_build("v1", "tools/list", "p0", must_not_build) == body
    assert (first.stats["misses"], second.stats["shared_hits"], second.stats["near_hits"]) == (
        1,
        1,
        1,
    )
    key = catalog_key("v1", "tools/list", "p0")
    assert await raw_redis.get(key) == b"kvgate-entry/1 v1\n" + body  # the claimed version
    assert 0 < await raw_redis.ttl(key) <= 60
    for cache in (first, second):
        assert cache.stats["degraded"] is False and cache.stats["redis_errors"] == 0
        await cache.close()


async def test_version_published_by_one_reaches_the_other_within_a_second(redis_server, raw_redis):
    first = await started(redis_server.url, timeout_s=GENEROUS_TIMEOUT_S)
    second = await started(redis_server.url, timeout_s=GENEROUS_TIMEOUT_S)
    versions = second.versions()
    await first.publish_version("v2")
    assert await next_version(versions) == "v2"
    assert await second.current_version() == "v2"
    assert await raw_redis.get(VERSION_KEY) == b"v2"
    late = await started(redis_server.url, timeout_s=GENEROUS_TIMEOUT_S)
    assert await late.current_version() == "v2"  # a process started later adopts it
    for cache in (first, second, late):
        await cache.close()
    assert [v async for v in versions] == []  # close() ends the iteration


CHILD = textwrap.dedent("""
    import asyncio, json, sys
    from kvgate.gateway.app import make_discovery_cache

    async def main(url):
        cache = make_discovery_cache(url, timeout_s=0.5)
        await cache.start()
        versions = cache.versions()
        print("ready", flush=True)
        heard = await asyncio.wait_for(anext(versions), timeout=5)
        built = b'{"resultType":"complete","tools":["from-child"]}'
        body = await cache.get_or_build(heard, "tools/list", "p0", lambda: built)
        await cache.publish_version("v-child")
        print(json.dumps({"heard": heard, "body": body.decode(), **cache.stats}), flush=True)
        await cache.close()

    asyncio.run(main(sys.argv[1]))
""")


async def test_two_os_processes_share_versions_and_entries(redis_server):
    parent = await started(redis_server.url, timeout_s=GENEROUS_TIMEOUT_S)
    versions = parent.versions()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, redis_server.url],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        ready = await asyncio.wait_for(asyncio.to_thread(child.stdout.readline), timeout=30)
        assert ready.strip() == "ready"
        await parent.publish_version("v-parent")
        assert await next_version(versions) == "v-parent"  # its own announcement
        assert await next_version(versions) == "v-child"
        report = json.loads(await asyncio.to_thread(child.stdout.readline))
    finally:
        child.wait(timeout=10)
        child.stdout.close()
    assert report["heard"] == "v-parent" and report["misses"] == 1
    assert (
        await parent.get_or_build("v-parent", "tools/list", "p0", must_not_build)
        == b'{"resultType":"complete","tools":["from-child"]}'
    )
    await parent.close()


async def test_redis_killed_and_restarted_during_a_request_loop(redis_server, caplog):
    caplog.set_level(logging.WARNING, logger="kvgate.gateway.catalog.redis_cache")
    cache = await started(redis_server.url, near_cache_size=4, timeout_s=0.05)
    await cache.publish_version("v1")
    versions = cache.versions()
    saw_degraded = asyncio.Event()

    async def kill_then_restart() -> None:
        await asyncio.sleep(0.3)
        await asyncio.to_thread(redis_server.kill)
        await saw_degraded.wait()
        await asyncio.sleep(0.3)
        await asyncio.to_thread(redis_server.start)

    chaos = asyncio.create_task(kill_then_restart())
    poisoner = aioredis.from_url(redis_server.url, socket_timeout=0.05)

    async def poison(n: int) -> None:
        """Hostile bytes where entries and versions live (Redis may be down: then nothing)."""
        key = catalog_key("v1", "tools/list", f"p{n % 32}")
        with contextlib.suppress(Exception):
            await poisoner.set(key, POISON[n % len(POISON)])
            await poisoner.publish(EVENTS_CHANNEL, b"\xff\xfe not utf-8 %d" % n)

    async def one_request(n: int) -> bool:
        """True when the request got its right answer (any exception counts as a failure)."""
        try:
            body = await cache.get_or_build("v1", "tools/list", f"p{n}", lambda: result(n))
        except Exception:
            return False
        return body == result(n)

    failures, calls = 0, 0
    deadline = time.monotonic() + 15
    while not chaos.done() and time.monotonic() < deadline:
        # 8 concurrent requests over more keys than the near-cache holds: most reach Redis.
        await poison(calls)
        results = await asyncio.gather(*(one_request((calls + i) % 32) for i in range(8)))
        failures += results.count(False)
        calls += len(results)
        if cache.degraded and not redis_server.running:
            saw_degraded.set()
        await asyncio.sleep(0.005)
    await chaos
    await poisoner.aclose()
    assert failures == 0 and calls > 100  # not one poisoned byte was served
    await wait_until(lambda: not cache.degraded, within_s=5)
    stats = cache.stats
    assert stats["outages"] == 1 and stats["recoveries"] == 1
    assert stats["redis_errors"] >= 1 and stats["degraded_requests"] > 0
    messages = [r.getMessage() for r in caplog.records]
    assert sum("unavailable" in m for m in messages) == 1
    assert sum("reachable again" in m for m in messages) == 1

    other = await started(redis_server.url, timeout_s=GENEROUS_TIMEOUT_S)
    assert await other.current_version() == "v1"  # restored into the empty Redis, unannounced
    await other.publish_version("after-restart")
    assert await next_version(versions) == "after-restart"  # re-subscribed by itself
    assert stats["bad_entries"] > 0 and stats["bad_versions"] > 0  # the poison was seen
    assert await other.get_or_build("v1", "tools/list", "p0", lambda: b"x") in (result(0), b"x")
    await other.close()
    await cache.close()


async def test_poisoned_entries_are_rebuilt_never_served_nor_kept(redis_server, raw_redis, caplog):
    caplog.set_level(logging.WARNING, logger="kvgate.gateway.catalog")
    cache = await started(redis_server.url, timeout_s=GENEROUS_TIMEOUT_S)
    for n, poison in enumerate(POISON):
        key = catalog_key("v1", "tools/list", f"p{n}")
        await raw_redis.set(key, poison)
        good = result(n)
        assert await cache.get_or_build("v1", "tools/list", f"p{n}", lambda: good) == good  # noqa: B023
        assert await raw_redis.get(key) == b"kvgate-entry/1 v1\n" + good  # repaired
        await raw_redis.delete(key)  # what was kept near is the good body, not the poison
        assert await cache.get_or_build("v1", "tools/list", f"p{n}", must_not_build) == good
    stats = cache.stats
    assert stats["bad_entries"] == len(POISON) and stats["shared_hits"] == 0
    assert sum("unusable discovery entry" in r.getMessage() for r in caplog.records) == 1
    await cache.close()


async def test_an_entry_of_another_type_or_oversized_is_a_miss_not_an_outage(
    redis_server, raw_redis
):
    """A hash under an entry's key (or the version's) failed the read with WRONGTYPE, which
    marked Redis down: every request went local until the supervisor reconnected; a 24 MiB
    entry was fetched whole. Both are now a miss, rebuilt and written over; Redis stays up."""
    cache = await started(redis_server.url, timeout_s=GENEROUS_TIMEOUT_S)
    hashed, huge = catalog_key("v1", "tools/list", "hash"), catalog_key("v1", "tools/list", "huge")
    await raw_redis.hset(hashed, mapping={"resultType": "complete"})
    await raw_redis.set(huge, b"kvgate-entry/1 v1\n" + b" " * (24 << 20))
    await raw_redis.hset(VERSION_KEY, mapping={"v": "1"})
    for key, params in ((hashed, "hash"), (huge, "huge")):
        good = result(params)
        assert await cache.get_or_build("v1", "tools/list", params, lambda: good) == good  # noqa: B023
        assert await raw_redis.get(key) == b"kvgate-entry/1 v1\n" + good  # written over
    assert await cache.current_version() is None
    assert not cache.degraded and cache.stats["outages"] == 0
    await cache.close()


async def test_the_listener_survives_any_input_and_any_failure(redis_server, raw_redis):
    """Non-UTF-8 and oversized pub/sub messages and a garbage version key are ignored
    (counted); an unforeseen error in the listener restarts it; it hears peers after all."""
    events: list[str] = []
    cache = await started(redis_server.url, timeout_s=GENEROUS_TIMEOUT_S, on_event=events.append)
    versions = cache.versions()
    for garbage in (b"\xff\xfe\xfd", b"v" * 1000, b"", b"a b"):
        await raw_redis.publish(EVENTS_CHANNEL, garbage)
    await raw_redis.set(VERSION_KEY, b"\x80garbage")
    assert await cache.current_version() is None  # the garbage key is not adopted
    await raw_redis.publish(EVENTS_CHANNEL, b"v-good")
    assert await next_version(versions) == "v-good"
    assert cache.stats["bad_versions"] == 5 and "bad_version" in events

    original, failures = cache._listen, [RuntimeError("a bug nobody foresaw")]

    async def failing_once(pubsub):
        if failures:
            raise failures.pop()
        await original(pubsub)

    cache._listen = failing_once
    cache._trouble.set()  # the listener reconnects, and its next listen raises
    await wait_until(lambda: cache.stats["listener_restarts"] == 1, within_s=3)
    await raw_redis.publish(EVENTS_CHANNEL, b"v-after-restart")
    await wait_until(lambda: not cache.degraded, within_s=3)
    await raw_redis.publish(EVENTS_CHANNEL, b"v-after-restart")
    assert await next_version(versions, within_s=3) == "v-after-restart"
    assert "listener_restart" in events
    await cache.close()  # and it closes cleanly


async def test_paused_redis_never_holds_a_request_past_the_timeout(redis_server, raw_redis):
    timeout_s = 0.05
    cache = await started(redis_server.url, timeout_s=timeout_s, backoff_s=(0.05, 0.2))
    watcher = await started(redis_server.url, timeout_s=GENEROUS_TIMEOUT_S)
    versions = watcher.versions()
    await raw_redis.execute_command("CLIENT", "PAUSE", 800, "ALL")
    slowest = 0.0
    for n in range(20):
        began = time.monotonic()
        body = result(n, "prompts")
        assert await cache.get_or_build("v1", "prompts/list", f"p{n}", lambda: body) == body  # noqa: B023
        slowest = max(slowest, time.monotonic() - began)
    began = time.monotonic()
    await cache.publish_version("v-during-pause")
    slowest = max(slowest, time.monotonic() - began)
    assert slowest < timeout_s + 0.15  # versus the 800 ms pause
    assert cache.degraded and cache.stats["redis_errors"] >= 1
    # Once the pause ends, the version published meanwhile reaches the other process.
    assert await next_version(versions, within_s=3) == "v-during-pause"
    await wait_until(lambda: not cache.degraded, within_s=3)
    await cache.close()
    await watcher.close()


async def test_redis_down_at_start_then_up(tmp_path):
    server = RedisServer(tmp_path, port=free_port())
    cache = await started(server.url, timeout_s=0.05, backoff_s=(0.05, 0.2))
    assert cache.degraded
    assert await cache.get_or_build("v1", "tools/list", "p0", lambda: b"local") == b"local"
    versions = cache.versions()
    await cache.publish_version("v-offline")
    assert await next_version(versions) == "v-offline"  # local listeners hear it at once
    with server:
        await wait_until(lambda: not cache.degraded, within_s=3)
        client = aioredis.from_url(server.url)
        assert await client.get(VERSION_KEY) == b"v-offline"  # written on reconnect
        await client.aclose()
        await cache.close()


def test_two_gateways_share_the_catalog_and_hear_each_others_changes(
    redis_server, engine, tmp_path
):
    """Two kvgate apps on one Redis and one catalog config: one catalog; a config change
    reloaded by the first reaches the second within a second, as list_changed on its
    `subscriptions/listen` stream, and the second then serves the new catalog."""
    config = tmp_path / "catalog.json"
    config.write_text(json.dumps({"instructions": "Version one."}))
    options = dict(
        redis_url=redis_server.url,
        keepalive_s=0.2,
        catalog_config=str(config),
        admin_api_key="secret",
    )
    listen = {
        "jsonrpc": "2.0",
        "id": "watch",
        "method": "subscriptions/listen",
        "params": {"notifications": {"toolsListChanged": True}, "_meta": modern_meta()},
    }
    with (
        LiveServer(engine, **options) as first,
        LiveServer(engine, **options) as second,
        httpx.Client(timeout=10) as http,
    ):
        lists = [call(http, gateway.url, "tools/list", {}).body for gateway in (first, second)]
        assert lists[0] == lists[1]
        assert second.app.state.discovery_cache.stats["shared_hits"] == 1  # built by the first
        with http.stream(
            "POST",
            second.url,
            content=orjson.dumps(listen),
            headers=modern_headers("subscriptions/listen"),
        ) as response:
            messages = sse_messages(response)
            assert next(messages)["method"] == "notifications/subscriptions/acknowledged"
            config.write_text(json.dumps({"instructions": "Version two."}))
            began = time.monotonic()
            reloaded = http.post(
                first.base + "/admin/catalog/reload", headers={"Authorization": "Bearer secret"}
            ).json()
            change = next(messages)
            elapsed = time.monotonic() - began
        discovered = call(http, second.url, "server/discover").result
    assert reloaded["changed"] and reloaded["version"] == second.app.state.served.current.version
    assert change["method"] == "notifications/tools/list_changed"
    assert change["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == "watch"
    assert elapsed < 1.0
    assert discovered["instructions"] == "Version two."


def sse_messages(response: httpx.Response):
    """The JSON-RPC messages of an SSE response, skipping keep-alive comments."""
    for line in response.iter_lines():
        if line.startswith("data:"):
            yield orjson.loads(line[5:])


def test_redis_trouble_shows_in_metrics(redis_server, engine):
    """Killed Redis: requests still answered, fallbacks counted, the degraded gauge at 1;
    restarted: the gauge back at 0 by itself."""

    def metric(http, live, line_start: str) -> float:
        lines = http.get(live.base + "/metrics").text.splitlines()
        return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(line_start))

    with LiveServer(engine, redis_url=redis_server.url) as live, httpx.Client(timeout=10) as http:
        assert metric(http, live, "kvgate_discovery_cache_degraded ") == 0.0
        redis_server.kill()
        answered = [
            call(http, live.url, method).status
            for method in ("tools/list", "prompts/list", "resources/list", "tools/list")
        ]
        degraded = metric(http, live, "kvgate_discovery_cache_degraded ")
        fallbacks = metric(http, live, 'kvgate_discovery_cache_events_total{event="degraded"}')
        outages = metric(http, live, 'kvgate_discovery_cache_events_total{event="outage"}')
        redis_server.start()
        deadline = time.monotonic() + 5
        while metric(http, live, "kvgate_discovery_cache_degraded ") != 0.0:
            assert time.monotonic() < deadline, "never recovered"
            time.sleep(0.05)
    assert answered == [200] * 4
    assert degraded == 1.0 and fallbacks >= 2 and outages == 1.0
