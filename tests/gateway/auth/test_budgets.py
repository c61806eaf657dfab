"""Per-tenant budgets: the token bucket (in Redis through one Lua script, and the local
fallback), Retry-After from the bucket, Redis outages (budget/N, logged once, recovered), and
two real gateway processes enforcing one shared budget."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate.gateway.auth import budgets as budgets_module
from kvgate.gateway.auth.budgets import Budgets, LocalBuckets, Take
from kvgate.gateway.calls.errors import Refused as Refusal
from tests.gateway.live_server import LiveServer
from tests.gateway.redis_fixtures import RedisServer, requires_redis_server
from tests.gateway.wire import call


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with RedisServer(tmp_path) as server:
        yield server


def test_local_buckets_refill_allow_debt_and_say_when() -> None:
    buckets = LocalBuckets()
    per_ms = 60 / 60_000  # 60 a minute: one a second
    take = Take("k", 60, per_ms, 1, 1)
    assert all(buckets.take([take]) == 0 for _ in range(60))
    assert 0 < buckets.take([take]) <= 1000  # the next one refills within a second
    debt = Take("t", 10, per_ms, 25, -1e300)
    assert buckets.take([debt]) == 0  # a debit always goes through, into debt
    wait = buckets.take([Take("t", 10, per_ms, 0, 1)])
    assert 15_000 < wait <= 16_000  # 15 tokens of debt + 1 needed, at one a second


async def admitted(budgets: Budgets, tenant: str, tries: int) -> tuple[int, list[Refusal]]:
    ok, refused = 0, []
    for _ in range(tries):
        try:
            await budgets.admit(tenant)
            ok += 1
        except Refusal as refusal:
            refused.append(refusal)
    return ok, refused


@requires_redis_server
async def test_the_redis_bucket_is_shared_and_times_retry_after(redis_server: RedisServer) -> None:
    one, two = (Budgets(3, 0, redis_server.url, processes=2) for _ in range(2))
    try:
        ok_one, _ = await admitted(one, "acme", 2)
        ok_two, refused = await admitted(two, "acme", 3)  # another process, the same bucket
        assert (ok_one, ok_two) == (2, 1)
        assert {r.status for r in refused} == {429} and refused[0].reason == "tenant_budget"
        assert refused[0].retry_after_s in (19, 20)  # one request per 20 s refills
        assert (await admitted(two, "globex", 3))[0] == 3  # tenants have their own buckets
    finally:
        await one.close()
        await two.close()


@requires_redis_server
async def test_a_bucket_written_by_others_is_refilled_not_trusted(
    redis_server: RedisServer,
) -> None:
    import redis.asyncio as aioredis

    budgets = Budgets(2, 0, redis_server.url, processes=2)
    writer = aioredis.from_url(redis_server.url)
    key = budgets._take("acme", "requests", 2, 1, 1).key
    junk: list[tuple[str, object]] = [
        ("set", "not a bucket"),
        ("hset", {"level": "nan", "at": "0"}),
        ("hset", {"level": "1e308", "at": "inf"}),
        ("hset", {"level": "-inf", "at": "nan"}),
        ("rpush", "[1, 2]"),
    ]
    try:
        for command, value in junk:
            await writer.delete(key)
            if command == "hset":
                await writer.hset(key, mapping=value)  # type: ignore[arg-type]
            else:
                await getattr(writer, command)(key, value)
            ok, refused = await admitted(budgets, "acme", 3)
            assert (ok, len(refused)) == (2, 1), (command, value)  # the whole budget, no more
            assert not budgets.degraded  # answered by Redis, not the local fallback
    finally:
        await writer.aclose()
        await budgets.close()


@requires_redis_server
async def test_redis_down_falls_back_to_a_share_logs_once_and_recovers(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(budgets_module, "PROBE_EVERY_S", 0.2)
    budgets = Budgets(4, 0, redis_server.url, processes=2)
    try:
        assert (await admitted(budgets, "acme", 1))[0] == 1
        redis_server.kill()
        with caplog.at_level(logging.WARNING, "kvgate.auth"):
            ok, _ = await admitted(budgets, "acme", 5)
            await asyncio.sleep(0.3)
            ok_later, _ = await admitted(budgets, "acme", 2)  # probes Redis again: still down
            assert budgets.degraded
            assert (ok, ok_later) == (2, 0)  # this process's half of 4, in its own bucket
            down = [r for r in caplog.records if "unreachable" in r.getMessage()]
            assert len(down) == 1
            redis_server.start()
            await asyncio.sleep(0.3)
            assert (await admitted(budgets, "acme", 4))[0] == 4  # the (fresh) shared bucket
            assert not budgets.degraded
            assert any("reachable again" in r.getMessage() for r in caplog.records)
    finally:
        await budgets.close()


async def test_without_redis_each_process_enforces_its_share() -> None:
    halves = Budgets(4, 0, None, processes=2)
    assert (await admitted(halves, "acme", 5))[0] == 2  # one of two processes sharing 4
    tiny = Budgets(1, 0, None, processes=4)  # a share under one call still admits one
    ok, refused = await admitted(tiny, "acme", 3)
    assert ok == 1 and 230 <= refused[0].retry_after_s <= 240  # 1/4 of a request a minute
    await halves.close()
    await tiny.close()


def keys_file(path: Path) -> str:
    lines = [
        f"{t}: {hashlib.sha256(f'{t}-key'.encode()).hexdigest()}\n" for t in ("acme", "globex")
    ]
    path.write_text("".join(lines))
    return str(path)


@requires_redis_server
def test_two_gateway_processes_enforce_one_budget(
    kvgate_factory,
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    flags = (
        "--redis-url", redis_server.url,
        "--api-keys-file", keys_file(tmp_path / "keys"),
        "--budget-requests-per-min", "6",
        "--budget-tokens-per-min", "100",
        "--budget-processes", "2",
    )  # fmt: skip
    gateways = [kvgate_factory(*flags), kvgate_factory(*flags)]

    def complete(i: int, tenant: str, max_tokens: int) -> httpx.Response:
        body = {"prompt": "Once", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        headers = {"Authorization": f"Bearer {tenant}-key"}
        url = gateways[i % 2].base + "/v1/completions"
        return httpx.post(url, json=body, headers=headers, timeout=60)

    started = time.monotonic()
    small = [complete(i, "acme", 1) for i in range(10)]  # alternating between the processes
    passed = [r for r in small if r.status_code == 200]
    limit = 6 + int((time.monotonic() - started) / 10)  # refills one request per 10 s
    assert 6 <= len(passed) <= limit
    assert {r.status_code for r in small[len(passed) :]} == {429}
    refusal = small[-1]
    assert 1 <= int(refusal.headers["retry-after"]) <= 10
    assert refusal.json()["error"]["code"] == "rate_limit_exceeded"

    large = [complete(i, "globex", 40) for i in range(5)]
    used = [r.json()["usage"]["total_tokens"] for r in large if r.status_code == 200]
    assert [r.status_code for r in large][len(used) :] == [429] * (5 - len(used))
    assert 100 <= sum(used) <= 100 + max(used)  # overshot by at most one call's tokens


def test_mcp_tool_calls_spend_the_request_budget(engine, tmp_path: Path) -> None:
    generate = {"name": "generate", "arguments": {"prompt": "hi", "max_tokens": 1}}
    headers = {"Authorization": "Bearer acme-key"}
    keys = keys_file(tmp_path / "keys")
    with LiveServer(engine, api_keys_file=keys, budget_requests_per_min=1) as live:
        with httpx.Client(timeout=60) as http:
            first = call(http, live.url, "tools/call", generate, name="generate", headers=headers)
            second = call(http, live.url, "tools/call", generate, name="generate", headers=headers)
            listing = call(http, live.url, "tools/list", headers=headers)
    assert first.status == 200
    assert second.status == 429 and second.body["id"] == 1
    assert second.error["data"]["reason"] == "tenant_budget"
    assert 50 <= int(second.headers["retry-after"]) <= 60  # one call a minute
    assert listing.status == 200  # discovery is not a budgeted call


def test_workers_without_redis_split_the_budget(kvgate_factory, tmp_path: Path) -> None:
    """``--workers 2``, no Redis: each worker enforces budget / 2, so of 16 calls spread over
    both at most 10 pass (5 a worker; refills add one a worker per 12 s)."""
    flags = ("--api-keys-file", keys_file(tmp_path / "keys"), "--budget-requests-per-min", "10")
    gateway = kvgate_factory("--workers", "2", *flags)
    body = {"prompt": "Once", "max_tokens": 1, "temperature": 0}
    headers = {"Authorization": "Bearer acme-key"}
    deadline = time.monotonic() + 60
    ready = 0
    while ready < 8:  # eight fresh connections in a row found a ready worker: both are up
        assert time.monotonic() < deadline, "a worker did not become ready"
        ready = ready + 1 if httpx.get(gateway.base + "/readyz").status_code == 200 else 0
    started = time.monotonic()
    codes = [  # a new connection each: the kernel spreads them over both workers
        httpx.post(gateway.base + "/v1/completions", json=body, headers=headers, timeout=60)
        for _ in range(16)
    ]
    passed = sum(r.status_code == 200 for r in codes)
    refills = 2 * int((time.monotonic() - started) / 12)
    assert 5 <= passed <= 10 + refills, [r.status_code for r in codes]
    assert {r.status_code for r in codes if r.status_code != 200} == {429}
