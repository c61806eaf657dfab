"""``Placements`` against a private redis-server, straight and behind a proxy that hands every
reply on late: a call waits at most its bound (none while a read is overdue), the late answer
is still read and heard, a key it placed elsewhere follows the call, and what one process
places every other hears; a record that is not one (another type, oversized, binary) is
replaced, junk heard is ignored, and each tenant's salt keys records of its own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis

from kvgate.gateway import redis_connection
from kvgate.gateway.upstream.placement import CHANNEL, COUNTS, PREFIX, Placements, placement_key
from tests.gateway.redis_fixtures import RedisServer, requires_redis_server
from tests.gateway.upstream.late_proxy import late_proxy

pytestmark = [requires_redis_server, pytest.mark.redis]
LATE_S = 0.1  # a new connection takes a few replies: all within ANSWER_S
BOUND_S = 0.02
UPSTREAMS = [("http://a", 0), ("http://b", 0), ("http://c", 0)]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path) as server:
        yield server


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    client.close()


async def opened(url: str, timeout_s: float = BOUND_S) -> Placements:
    placements = Placements(redis_connection.connect(url, socket_timeout=1.0), timeout_s)
    await placements.connect()
    return placements


@pytest.fixture
async def late(redis_server: RedisServer) -> AsyncIterator[Placements]:
    with late_proxy(redis_server.port, LATE_S) as port:
        placements = await opened(f"redis://127.0.0.1:{port}/0")
        yield placements
        await placements.aclose()


async def heard(placements: Placements, key: bytes, url: str) -> None:
    deadline = time.monotonic() + 5
    while placements.near(key)[0] != url:
        assert time.monotonic() < deadline, f"{key!r} not heard as {url}"
        await asyncio.sleep(0.02)


async def test_a_call_waits_at_most_its_bound_and_none_while_a_read_is_overdue(
    late: Placements,
) -> None:
    first = late.ask(b"k1", UPSTREAMS)
    assert first is not None and await late.wait(first) is None
    began = time.monotonic()
    second = late.ask(b"k2", UPSTREAMS)
    assert second is not None and await late.wait(second) is None
    assert time.monotonic() - began < BOUND_S  # the first one is overdue: no wait at all
    answer = await first  # still read, and heard
    assert answer is not None and answer.placed and late.near(b"k1") == (answer.url, True)


async def test_a_key_placed_after_its_call_left_moves_to_where_the_call_went(
    late: Placements, store: redis.Redis
) -> None:
    store.hset("kvgate:{placement}counts", mapping={"http://a": 0, "http://b": 9, "http://c": 9})
    asked = late.ask(b"k", UPSTREAMS)
    assert asked is not None and await late.wait(asked) is None
    late.settle(b"k", asked, "http://c")  # the call went by the hash
    await heard(late, b"k", "http://c")
    assert store.get(PREFIX + "k") == "http://c"
    assert store.hgetall("kvgate:{placement}counts") == {
        "http://a": "0",
        "http://b": "9",
        "http://c": "10",
    }


async def test_a_record_read_is_not_moved_and_a_moved_one_is_not_moved_again(
    late: Placements, store: redis.Redis
) -> None:
    store.set(PREFIX + "k", "http://b")
    asked = late.ask(b"k", UPSTREAMS)
    assert asked is not None and await late.wait(asked) is None
    late.settle(b"k", asked, "http://c")  # another process placed it: that call went astray
    answer = await asked
    assert answer is not None and not answer.placed
    await asyncio.sleep(LATE_S * 2)
    assert store.get(PREFIX + "k") == "http://b"


async def test_what_one_process_places_every_other_hears(redis_server: RedisServer) -> None:
    one, other = await opened(redis_server.url, 1.0), await opened(redis_server.url, 1.0)
    try:
        await asyncio.sleep(0.2)  # subscribed
        asked = one.ask(b"k", UPSTREAMS)
        assert asked is not None
        answer = await one.wait(asked)
        assert answer is not None and answer.placed
        await heard(other, b"k", answer.url)
    finally:
        await one.aclose()
        await other.aclose()


async def test_redis_down_answers_none_at_once_and_backs_off(tmp_path: Path) -> None:
    server = RedisServer(tmp_path)  # never started: connections are refused
    placements = await opened(server.url)
    try:
        asked = placements.ask(b"k", UPSTREAMS)
        assert asked is not None and await asked is None
        assert placements.ask(b"k", UPSTREAMS) is None  # left alone for a while
    finally:
        await placements.aclose()


async def test_a_record_that_is_not_one_is_replaced_and_junk_heard_is_ignored(
    redis_server: RedisServer,
) -> None:
    """A hash under a record's key failed the script (WRONGTYPE): Redis was taken for down
    for a second at each call; a 24 MiB string came back whole; a record that is not UTF-8
    failed its decoding (a 500 for the call); a message heard that is not UTF-8 ended the
    listener for good. Each is now no record: placed anew, heard as nothing."""
    placements = await opened(redis_server.url, 1.0)
    raw = redis.Redis.from_url(redis_server.url)
    try:
        await asyncio.sleep(0.2)  # subscribed
        raw.set(COUNTS, b"not a hash")
        junk: list[tuple[str, object]] = [
            ("hash", {"url": "http://a"}),
            ("huge", b"h" * (24 << 20)),
            ("binary", b"\xff\xfehttp://a"),
            ("spaced", b"http://a b"),
        ]
        for name, value in junk:
            key = PREFIX + name
            if isinstance(value, dict):
                raw.hset(key, mapping=value)
            else:
                raw.set(key, value)
            asked = placements.ask(name.encode(), UPSTREAMS)
            assert asked is not None
            answer = await placements.wait(asked)
            assert answer is not None and answer.placed, name
            assert raw.get(key) == answer.url.encode()
        raw.publish(CHANNEL, b"\xff\xfe\nheard")
        raw.publish(CHANNEL, b"http://b\nheard")  # the listener is still there
        await heard(placements, b"heard", "http://b")
    finally:
        raw.close()
        await placements.aclose()


def test_each_salt_keys_its_own_records() -> None:
    """Two tenants naming one ``cache_key`` (or sending one prompt) shared one record: the
    second followed, refreshed or moved the first's. Their salts now key records apart."""
    hashes = [b"\x01" * 32]
    for cache_key in ("session-1", None):
        acme = placement_key(hashes, cache_key, "tenant:acme-salt")
        globex = placement_key(hashes, cache_key, "tenant:globex-salt")
        assert acme is not None and globex is not None and acme != globex
        assert placement_key(hashes, cache_key, "tenant:acme-salt") == acme
    assert placement_key(hashes, "session-1", None) == b"cache_key:session-1"  # no tenants
    assert placement_key([], None, "tenant:acme-salt") is None
