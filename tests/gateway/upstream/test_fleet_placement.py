"""Balanced first placement through Redis, with real processes: two gateways of two workers
over three upstreams and a private redis-server. New keys are spread evenly and recorded,
every gateway and worker follows a record (refreshing its TTL), a record naming a dead
upstream is replaced, and with Redis down the hash decides with no failed call. A third
gateway (``hasty``) never waits for Redis, as any gateway whose answer comes late: the first
call of a new key goes by the hash and the record follows it, and records it heard of are
followed with no read."""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis

from kvgate.gateway.upstream.routing import Load, UpstreamRouter
from tests.gateway.redis_fixtures import RedisServer, requires_redis_server
from tests.gateway.upstream.late_proxy import late_proxy
from tests.gateway.upstream.processes import Process, gateway, running
from tests.gateway.upstream.recording_upstream import MODEL

pytestmark = [requires_redis_server, pytest.mark.redis]
RECORDING = ("-m", "tests.gateway.upstream.recording_upstream")
COUNTS = "kvgate:{placement}counts"
LATE_S = 0.12  # past the bound (50 ms)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("placement")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def upstreams(log_dir: Path) -> Iterator[list[Process]]:
    with running([Process(log_dir, command=RECORDING) for _ in range(3)], 30) as started:
        yield started


@pytest.fixture(scope="module")
def fronts(
    log_dir: Path, upstreams: list[Process], redis_server: RedisServer
) -> Iterator[list[Process]]:
    flags = ("--workers", "2", "--redis-url", redis_server.url)
    slow = {"KVGATE_UPSTREAM_PLACEMENT_TIMEOUT_S": "0.5"}  # a busy test machine is slow
    fronts = [gateway(log_dir, upstreams, *flags, **slow) for _ in range(2)]
    with running(fronts, 60) as started:
        yield started


@pytest.fixture(scope="module")
def hasty(log_dir: Path, upstreams: list[Process], redis_server: RedisServer) -> Iterator[Process]:
    """A gateway of two workers whose Redis answers come after the bound (50 ms), as on a
    busy machine: every reply is handed on ``LATE_S`` late. Its client waits 2 s for one,
    not 0.25 s: on a loaded test machine the late reply must still be read, or no record
    follows the call (the case under test)."""
    with late_proxy(redis_server.port, LATE_S) as port:
        url = f"redis://127.0.0.1:{port}/0?socket_timeout=2"
        flags = ("--workers", "2", "--redis-url", url)
        with running([gateway(log_dir, upstreams, *flags)], 60) as started:
            yield started[0]


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    client.close()


def served_by(base: str, key: str) -> str:
    """The upstream a fresh connection's call for ``key`` went to (any worker may take it)."""
    with httpx.Client(timeout=10) as client:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "cache_key": key}
        response = client.post(base + "/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.headers["x-kvgate-upstream"]


def record(key: str) -> str:
    return f"kvgate:{{placement}}:cache_key:{key}"


def all_listening(store: redis.Redis, workers: int) -> None:
    """Wait until ``workers`` worker processes hear placements."""
    deadline = time.monotonic() + 10
    while store.pubsub_numsub("kvgate:{placement}heard")[0][1] < workers:
        assert time.monotonic() < deadline, "the workers did not subscribe"
        time.sleep(0.05)


def keys_hashed_away(upstreams: list[Process], favoured: Process, prefix: str) -> list[str]:
    """Six keys the hash gives to another upstream than ``favoured``."""
    router = UpstreamRouter([u.base for u in upstreams])
    idle, up = [Load(0)] * len(upstreams), [True] * len(upstreams)
    keys = (f"{prefix}-{i}" for i in range(1000))
    away = (k for k in keys if upstreams[router.choose([], k, idle, up)[0]] is not favoured)
    return list(itertools.islice(away, 6))


@contextmanager
def favouring(store: redis.Redis, upstreams: list[Process], favoured: Process) -> Iterator[None]:
    """New keys are placed on ``favoured``: the others count many recent placements."""
    store.hset(COUNTS, mapping={u.base: 0 if u is favoured else 1000 for u in upstreams})
    try:
        yield
    finally:
        store.delete(COUNTS)


def test_a_late_answer_records_the_key_where_its_first_call_went(
    fronts: list[Process], hasty: Process, upstreams: list[Process], store: redis.Redis
) -> None:
    """The split the agent trace showed: the first call of a session went by the hash (Redis
    late) while its script, still run, recorded the least-loaded upstream — every later turn
    followed the record, away from the cached prefix."""
    favoured = upstreams[0]
    with favouring(store, upstreams, favoured):
        for key in keys_hashed_away(upstreams, favoured, "late"):
            url = served_by(hasty.base, key)  # by the hash: Redis is late for it
            assert url != favoured.base
            deadline = time.monotonic() + 5  # the late answer read, the record moved
            while store.get(record(key)) != url:
                found = store.get(record(key))
                assert time.monotonic() < deadline, f"{key} went to {url}, recorded {found}"
                time.sleep(0.05)
            assert {served_by(f.base, key) for f in (*fronts, hasty) for _ in range(2)} == {url}


def test_records_heard_of_are_followed_without_waiting_for_redis(
    fronts: list[Process], hasty: Process, upstreams: list[Process], store: redis.Redis
) -> None:
    """A gateway seeing a session for the first time, with Redis late, follows its record
    (heard when it was placed) rather than the hash."""
    all_listening(store, 6)
    favoured = upstreams[1]
    with favouring(store, upstreams, favoured):
        keys = keys_hashed_away(upstreams, favoured, "heard")
        assert {served_by(fronts[0].base, key) for key in keys} == {favoured.base}
        time.sleep(0.3)  # heard (LATE_S late) before the session's next turn
        assert {served_by(hasty.base, key) for key in keys for _ in range(3)} == {favoured.base}


def test_new_keys_are_spread_evenly_recorded_and_followed_everywhere(
    fronts: list[Process], upstreams: list[Process], store: redis.Redis
) -> None:
    keys = [f"even-{i}" for i in range(6)]
    placed = {key: served_by(fronts[0].base, key) for key in keys}
    assert sorted(Counter(placed.values()).values()) == [2, 2, 2]
    for key, url in placed.items():
        assert store.get(record(key)) == url and store.ttl(record(key)) > 60
        assert {served_by(front.base, key) for front in fronts for _ in range(3)} == {url}


def test_a_record_is_followed_and_its_ttl_refreshed_on_use(
    fronts: list[Process], upstreams: list[Process], store: redis.Redis
) -> None:
    for i, upstream in enumerate(upstreams):
        key = f"pinned-{i}"
        store.set(record(key), upstream.base, ex=5)
        assert served_by(fronts[1].base, key) == upstream.base
        assert store.ttl(record(key)) > 60  # read with GETEX: its TTL begins again
    # Expired: the next call places the key anew.
    store.set(record("expiring"), upstreams[0].base, px=200)
    time.sleep(0.3)
    url = served_by(fronts[0].base, "expiring")
    assert store.get(record("expiring")) == url and store.ttl(record("expiring")) > 60


def test_redis_down_leaves_the_hash_to_decide_with_no_failed_call(
    fronts: list[Process], redis_server: RedisServer
) -> None:
    redis_server.kill()
    try:
        for i in range(12):
            served_by(fronts[i % 2].base, f"no-redis-{i % 4}")  # each asserts a 200
    finally:
        redis_server.start()


def test_a_dead_upstreams_records_are_replaced(
    fronts: list[Process], upstreams: list[Process], store: redis.Redis
) -> None:
    victim = upstreams[2]
    store.set(record("orphan"), victim.base, ex=600)
    victim.stop()
    try:
        deadline = time.monotonic() + 10
        while any(f.readyz()["upstreams"][2]["state"] == "healthy" for f in fronts):
            assert time.monotonic() < deadline, "the dead upstream stayed in"
            time.sleep(0.1)
        time.sleep(0.5)  # every worker has seen its failed checks (each checks on its own)
        url = served_by(fronts[0].base, "orphan")
        assert url != victim.base and store.get(record("orphan")) == url
        assert served_by(fronts[1].base, "orphan") == url
    finally:
        victim.start().wait_ready(30)
