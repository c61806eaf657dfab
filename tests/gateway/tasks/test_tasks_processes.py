"""Tasks across gateway processes: two ``kvgate serve`` (embedded tiny model) on one private
Redis, over the real wire. A task made on A is answered by B: polled to its result, cancelled
(A's engine stops), failed once A is killed (its lease lapses), hidden from another tenant.
The two processes are started once for the module; the SIGKILL test runs last."""

from __future__ import annotations

import hashlib
import re
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
import redis

from tests.gateway.redis_fixtures import RedisServer, requires_redis_server
from tests.gateway.tasks.client import TASK_HINT, generate, poll_until, task_call
from tests.gateway.upstream.processes import Process, running

pytestmark = requires_redis_server
TENANTS = {"acme": "acme-key", "globex": "globex-key"}
A_KEY, B_KEY = TENANTS["acme"], TENANTS["globex"]
SHORT = {"prompt": "Once upon a time", "max_tokens": 24}
LONG = {"prompt": "A long story", "max_tokens": 3000}  # never ends early at temperature 0
LEASE_S = 1.0


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def gateways(
    redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[Process]]:
    logs = tmp_path_factory.mktemp("tasks")
    keys = logs / "keys"
    keys.write_text(
        "".join(f"{t}: {hashlib.sha256(k.encode()).hexdigest()}\n" for t, k in TENANTS.items())
    )
    flags = (
        "--redis-url",
        redis_server.url,
        "--api-keys-file",
        str(keys),
        "--task-lease-s",
        str(LEASE_S),
        "--task-poll-interval-s",
        "0.2",
    )
    # a generous wait: on a loaded 2-core machine a start has taken over a minute
    with running([Process(logs, *flags), Process(logs, *flags)], 300) as started:
        yield started


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as client:
        yield client


def mcp(process: Process) -> str:
    return process.base + "/mcp"


def running_requests(process: Process) -> float:
    match = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", process.metrics(), re.M)
    assert match is not None
    return float(match[1])


def test_a_task_made_on_a_completes_on_b_with_the_direct_answer(
    http: httpx.Client, gateways: list[Process]
) -> None:
    a, b = gateways
    with httpx.Client(timeout=30) as creator:  # gone right after CreateTaskResult
        created = generate(creator, mcp(a), SHORT, meta=TASK_HINT, key=A_KEY).result
    assert created["resultType"] == "task"
    done = poll_until(http, mcp(b), created["taskId"], ("completed",), key=A_KEY)
    direct = generate(http, mcp(b), SHORT, declared=False, key=A_KEY).result
    assert done["result"]["structuredContent"]["text"] == direct["structuredContent"]["text"]
    assert done["result"]["content"] == direct["content"]


def test_cancel_sent_to_b_stops_the_generation_on_a(
    http: httpx.Client, gateways: list[Process]
) -> None:
    a, b = gateways
    created = generate(http, mcp(a), LONG, meta=TASK_HINT, key=A_KEY).result
    working = poll_until(http, mcp(b), created["taskId"], ("working",), key=A_KEY)
    assert working["statusMessage"].endswith("tokens generated so far")
    # A's engine runs in a process of its own, whose stats reach A's /metrics every 0.25 s:
    # the running generation shows within that (and a 0 seen after it is a newer snapshot).
    deadline = time.monotonic() + 3
    while running_requests(a) != 1:
        assert time.monotonic() < deadline, "A's /metrics never showed the generation running"
        time.sleep(0.02)
    task_call(http, mcp(b), "tasks/cancel", created["taskId"], key=A_KEY)
    deadline = time.monotonic() + 5
    while running_requests(a) != 0:
        assert time.monotonic() < deadline, "A still runs the cancelled generation"
        time.sleep(0.02)
    poll_until(http, mcp(b), created["taskId"], ("cancelled",), key=A_KEY, timeout_s=5)


def test_another_tenant_cannot_see_a_task_on_any_process(
    http: httpx.Client, gateways: list[Process]
) -> None:
    a, b = gateways
    created = generate(http, mcp(a), SHORT, meta=TASK_HINT, key=A_KEY).result
    methods = {"tasks/get": {}, "tasks/cancel": {}, "tasks/update": {"inputResponses": {}}}
    for method, params in methods.items():
        unknown = task_call(http, mcp(b), method, "x" * 32, key=B_KEY, **params).error
        for process in (a, b):
            task_id = created["taskId"]
            other = task_call(http, mcp(process), method, task_id, key=B_KEY, **params).error
            assert other == unknown and other["code"] == -32602, method
    poll_until(http, mcp(b), created["taskId"], ("completed",), key=A_KEY)


def test_a_record_that_is_not_a_task_reads_as_not_found(
    http: httpx.Client, gateways: list[Process], redis_server: RedisServer
) -> None:
    _, b = gateways
    task_id = "z" * 32
    unknown = task_call(http, mcp(b), "tasks/get", "y" * 32, key=A_KEY).error
    key = f"kvgate:task:{task_id}"
    with redis.Redis.from_url(redis_server.url) as client:
        for junk in (b"not json", b'{"id": "zzz"}', b"[1, 2]", b"x" * (24 << 20), {"id": "z"}):
            client.delete(key)
            if isinstance(junk, dict):  # another type: WRONGTYPE was a -32603 naming it
                client.hset(key, mapping=junk)
            else:
                client.set(key, junk, px=60_000)
            error = task_call(http, mcp(b), "tasks/get", task_id, key=A_KEY).error
            assert error == unknown and error["code"] == -32602, repr(junk)[:40]


def test_a_task_whose_gateway_is_killed_reads_failed_within_its_lease(
    http: httpx.Client, gateways: list[Process]
) -> None:
    a, b = gateways
    created = generate(http, mcp(a), LONG, meta=TASK_HINT, key=A_KEY).result
    poll_until(http, mcp(b), created["taskId"], ("working",), key=A_KEY)
    a.signal(signal.SIGKILL)
    killed = time.monotonic()
    failed = poll_until(http, mcp(b), created["taskId"], ("failed",), key=A_KEY, timeout_s=10)
    assert time.monotonic() - killed < LEASE_S + 1.5
    assert failed["error"]["code"] == -32603 and "stopped" in failed["statusMessage"]
    again = task_call(http, mcp(b), "tasks/get", created["taskId"], key=A_KEY).result
    assert again["status"] == "failed"  # terminal: stays failed
