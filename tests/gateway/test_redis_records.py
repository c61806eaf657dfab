"""``RecordReader`` against a private redis-server: a record is read only when it is a string
within its bound (an oversized one never crosses the wire: Redis's own output counter says
so), another type is no record rather than ``WRONGTYPE``, and a value its check refuses reads
as absent; each problem is logged once per key."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvgate.gateway import redis_connection
from kvgate.gateway.redis_records import RecordReader, key_part
from tests.gateway.redis_fixtures import RedisServer, requires_redis_server

pytestmark = [pytest.mark.redis, requires_redis_server]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path) as server:
        yield server


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_server.url) as client:
        yield client


def sent_bytes(raw: redis.Redis) -> int:
    return int(raw.info("stats")["total_net_output_bytes"])


def positive(data: Any) -> int:
    if type(data) is not int or data <= 0:
        raise ValueError("not a positive integer")
    return data


async def test_only_a_string_within_its_bound_is_read(
    redis_server: RedisServer, raw: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    client = redis_connection.connect(redis_server.url, socket_timeout=1.0)
    reader = RecordReader(client)
    try:
        raw.set("good", b"12")
        raw.set("huge", b"1" * (24 << 20))
        raw.hset("hash", mapping={"a": "1"})
        raw.set("junk", b"not json")
        raw.set("negative", b"-3")
        with caplog.at_level(logging.WARNING, logger="kvgate.redis"):
            assert await reader.read("good", positive) == 12
            assert await reader.raw("good", limit=2) == b"12"
            assert await reader.raw("good", limit=1) is None
            assert await reader.read("absent", positive) is None
            before = sent_bytes(raw)
            assert await reader.raw("huge") is None
            assert sent_bytes(raw) - before < 4096  # the answer, and INFO's own reply
            for key in ("hash", "junk", "negative", "hash"):
                assert await reader.read(key, positive) is None
        logged = [r.getMessage() for r in caplog.records]
        assert len(logged) == 5, logged  # none for "absent"; none for "hash" read again
        assert "Redis record good is unusable (size 2): read as absent" in logged
        assert "Redis record huge is unusable (size 25165824): read as absent" in logged
        assert "Redis record hash is unusable (hash): read as absent" in logged
    finally:
        await client.aclose()


def test_a_key_part_is_short_and_tells_names_apart() -> None:
    assert key_part("key:acme") != key_part("key:globex")
    assert len(key_part("x" * 10_000)) == len(key_part("")) == 32
