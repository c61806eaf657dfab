"""Fleet mode against real upstreams: kvgate engine processes on loopback (no mocked HTTP).

One module-wide fleet of three upstreams; the tests run in file order and the later ones
break upstreams on purpose (SIGKILL, SIGSTOP), restoring what the next test needs.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest

from kvgate.gateway.upstream.routing import AFFINITY_SLACK
from tests.gateway.upstream.processes import (
    Process,
    gateway,
    generate,
    mcp_headers,
    running,
    tool_call,
)

# Greedy on the tiny model this never meets end-of-text: max_tokens tokens, a second or more.
LONG = {"prompt": "A long story", "max_tokens": 1500, "temperature": 0}
PROMPT = "The quick brown fox jumps over the lazy dog; " * 4  # > 2 chunks of 64 characters


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fleet")


@pytest.fixture(scope="module")
def upstreams(log_dir: Path) -> Iterator[list[Process]]:
    with running([Process(log_dir) for _ in range(3)]) as started:
        yield started


@pytest.fixture(scope="module")
def gateways(log_dir: Path, upstreams: list[Process]) -> Iterator[list[Process]]:
    """Two gateway processes over the same upstreams, with different Python hash seeds."""
    with running([gateway(log_dir, upstreams, PYTHONHASHSEED=seed) for seed in "12"], 60) as g:
        yield g


def owned_by(base: str, index: int, count: int = 1) -> list[str]:
    """Cache keys the gateway routes to upstream ``index`` while idle."""
    keys = []
    for i in range(200):
        key = f"session-{i}"
        if generate(base, cache_key=key, prompt="hi")["structuredContent"]["replica"] == index:
            keys.append(key)
            if len(keys) == count:
                return keys
    raise AssertionError(f"no key routes to upstream {index}")


def wait_for(condition, timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not condition():
        assert time.monotonic() - started < timeout_s, what
        time.sleep(0.05)
    return time.monotonic() - started


def states(g: Process) -> list[str]:
    return [u["state"] for u in g.readyz()["upstreams"]]


def test_every_gateway_routes_a_key_to_the_same_upstream(
    gateways: list[Process], upstreams: list[Process]
) -> None:
    picks: dict[str, list[int]] = {}
    for g in gateways:
        for key in (f"user-{i}" for i in range(12)):
            result = generate(g.base, cache_key=key, prompt="hi")["structuredContent"]
            assert result["upstream"] == upstreams[result["replica"]].base
            picks.setdefault(key, []).append(result["replica"])
        for i in range(4):  # no cache_key: the prompt's first chunks are the key
            result = generate(g.base, prompt=f"{i} {PROMPT}")["structuredContent"]
            picks.setdefault(f"prompt-{i}", []).append(result["replica"])
    assert all(a == b for a, b in picks.values()), picks
    assert len({a for a, _ in picks.values()}) > 1  # the keys spread over the upstreams
    # The same prompt again lands where its prefix is cached (the upstream says so).
    again = generate(gateways[1].base, prompt=f"0 {PROMPT}")["structuredContent"]
    assert again["replica"] == picks["prompt-0"][0] and again["cached_tokens"] > 0
    assert 'reason="key"' in gateways[0].metrics()


def test_a_hot_key_overflows_to_the_next_upstream(
    log_dir: Path, upstreams: list[Process], gateways: list[Process]
) -> None:
    """A burst on one key while the key's own upstream is paused (SIGSTOP), so every call sent
    there stays in flight however fast the machine: that upstream keeps AFFINITY_SLACK calls,
    then the bound ceil(1.25 (total + 1) / 3) sends the rest to its next upstream on the ring
    (the queue-driven case is in test_scrape.py). This gateway neither checks health nor
    scrapes, and waits on reads, so the pause is not mistaken for a stall (that case is
    test_a_stalled_upstream_is_detected_and_skipped)."""
    quiet = ("--upstream-health-interval", "0", "--upstream-scrape-interval", "0")
    g = gateway(log_dir, upstreams, *quiet, "--upstream-read-timeout", "120")
    with running([g], 60):
        (key,) = owned_by(g.base, 0)
        burst = AFFINITY_SLACK + 4
        pool = ThreadPoolExecutor(burst)
        upstreams[0].signal(signal.SIGSTOP)
        try:
            calls = [
                pool.submit(generate, g.base, 90, cache_key=key, prompt="hi", max_tokens=2)
                for _ in range(burst)
            ]
            overflowed = burst - AFFINITY_SLACK
            wait_for(lambda: sum(c.done() for c in calls) >= overflowed, 60, "no call overflowed")
        finally:
            upstreams[0].signal(signal.SIGCONT)
        replicas = [c.result()["structuredContent"]["replica"] for c in calls]
        pool.shutdown()
        others = [r for r in replicas if r != 0]
        assert len(others) == overflowed and len(set(others)) == 1, replicas
        assert 'reason="overflow"' in g.metrics()
    # The module's gateways saw the pause as a stall: the next tests want the upstream back.
    back = "the resumed upstream stayed out"
    wait_for(lambda: all(states(other)[0] == "healthy" for other in gateways), 10, back)


def stream_until_first_progress(base: str, arguments: dict, events: list, begun: threading.Event):
    """A streamed generate: every SSE event into ``events``; ``begun`` at the first progress."""
    body = orjson.dumps(tool_call(arguments, progress=True))
    with httpx.stream(
        "POST",
        base + "/mcp",
        content=body,
        headers=mcp_headers(arguments),
        timeout=30,
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(orjson.loads(line[5:]))
                if events[-1].get("method") == "notifications/progress":
                    begun.set()


def test_sigkill_mid_run_fails_only_the_streams_it_held_then_recovers(
    gateways: list[Process], upstreams: list[Process]
) -> None:
    g, victim = gateways[0], upstreams[2]
    keys = owned_by(g.base, 2, 2)
    streams = []
    for key in keys:
        events: list[dict] = []
        begun = threading.Event()
        thread = threading.Thread(
            target=stream_until_first_progress,
            args=(g.base, {**LONG, "cache_key": key}, events, begun),
        )
        thread.start()
        streams.append((thread, events, begun))
    for _, _, begun in streams:
        assert begun.wait(30)
    victim.signal(signal.SIGKILL)
    # Not yet streaming: calls for the dead upstream's keys, sent right after the kill.
    with ThreadPoolExecutor(6) as pool:
        later = list(
            pool.map(lambda k: generate(g.base, cache_key=k, prompt="hi"), [*keys, *keys, *keys])
        )
    assert [r["isError"] for r in later] == [False] * 6
    assert {r["structuredContent"]["replica"] for r in later} <= {0, 1}
    failed = 0
    for thread, events, _ in streams:
        thread.join(30)
        assert not thread.is_alive()
        final = events[-1]["result"]  # the stream ended with a result, not a hang
        if final["isError"]:  # it was on the victim (bounded load may have moved the other)
            assert "Generation failed" in final["content"][0]["text"]
            failed += 1
        else:
            assert final["structuredContent"]["replica"] != 2
    assert failed >= 1
    assert states(g)[2] != "healthy" and g.ready()  # still ready on the other two
    # Restarted on the same port, it is routed to again once a health check passes.
    victim.start().wait_ready()
    wait_for(lambda: states(g)[2] == "healthy", 10, "the restarted upstream stayed out")
    assert generate(g.base, cache_key=keys[0], prompt="hi")["structuredContent"]["replica"] == 2


def test_an_upstream_dying_mid_openai_call_is_retried_whole_or_an_error_event_then_done(
    gateways: list[Process], upstreams: list[Process]
) -> None:
    g, victim = gateways[1], upstreams[2]
    (key,) = owned_by(g.base, 2)
    model = httpx.get(g.base + "/v1/models", timeout=5).json()["data"][0]["id"]
    body = {"model": model, "prompt": "A long story", "max_tokens": 3000, "cache_key": key}

    def in_flight() -> int:
        return g.readyz()["upstreams"][2]["in_flight"]

    # Not streamed: it goes upstream as one JSON answer, so nothing was relayed when the
    # upstream died, and the call is retried whole on another one.
    with ThreadPoolExecutor(1) as pool:
        plain = pool.submit(
            httpx.post, g.base + "/v1/completions", json={**body, "temperature": 0}, timeout=30
        )
        wait_for(lambda: in_flight() == 1, 10, "the call never reached its upstream")
        time.sleep(0.3)  # it is generating
        victim.signal(signal.SIGKILL)
        response = plain.result()
    assert response.status_code == 200, response.text
    assert response.headers["x-kvgate-upstream"] != victim.base
    assert response.json()["choices"][0]["finish_reason"] == "length"

    victim.start().wait_ready()
    wait_for(lambda: states(g)[2] == "healthy", 10, "the restarted upstream stayed out")
    events: list[str] = []
    with httpx.stream(
        "POST", g.base + "/v1/completions", json={**body, "stream": True}, timeout=30
    ) as streamed:
        for line in streamed.iter_lines():
            if line.startswith("data:"):
                events.append(line[5:].strip())
                if len(events) == 3:  # streaming: now it dies
                    victim.signal(signal.SIGKILL)
    assert events[-1] == "[DONE]"
    assert "error" in orjson.loads(events[-2]) and "choices" in orjson.loads(events[0])
    victim.start().wait_ready()
    wait_for(lambda: states(g)[2] == "healthy", 10, "the restarted upstream stayed out")


def test_a_stalled_upstream_is_detected_and_skipped(
    gateways: list[Process], upstreams: list[Process]
) -> None:
    g, stalled = gateways[1], upstreams[1]
    (key,) = owned_by(g.base, 1)
    stalled.signal(signal.SIGSTOP)
    try:
        # Two failed checks 0.25 s apart, each timing out after 0.5 s.
        took = wait_for(lambda: states(g)[1] != "healthy", 5, "the stall went unnoticed")
        assert took < 3
        started = time.monotonic()
        result = generate(g.base, cache_key=key, prompt="hi")
        assert result["structuredContent"]["replica"] != 1
        assert time.monotonic() - started < 2  # skipped, not waited on
    finally:
        stalled.signal(signal.SIGCONT)
    wait_for(lambda: states(g)[1] == "healthy", 10, "the resumed upstream stayed out")
    assert generate(g.base, cache_key=key, prompt="hi")["structuredContent"]["replica"] == 1


def test_an_upstream_503_is_retried_elsewhere_and_none_left_is_503(
    log_dir: Path, upstreams: list[Process]
) -> None:
    """The 503s come from a real kvgate: a fleet gateway whose only upstream is gone."""
    lone = upstreams[2]
    refusing = gateway(log_dir, [lone]).start().wait_ready(60)
    front = gateway(log_dir, [refusing, upstreams[0]]).start().wait_ready(60)
    try:
        (key,) = owned_by(front.base, 0)
        lone.signal(signal.SIGKILL)
        wait_for(lambda: not refusing.ready(), 5, "the fleet without upstreams stayed ready")
        direct = httpx.post(
            refusing.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=5
        )
        assert direct.status_code == 503 and "retry-after" in direct.headers
        mcp = httpx.post(
            refusing.base + "/mcp",
            content=orjson.dumps(tool_call({"prompt": "hi", "cache_key": key})),
            headers=mcp_headers({"cache_key": key}),
            timeout=5,
        )
        assert mcp.status_code == 503 and mcp.json()["error"]["code"] == -31000
        result = generate(front.base, cache_key=key, prompt="hi")
        assert result["isError"] is False and result["structuredContent"]["replica"] == 1
        metrics = front.metrics()
        assert 'kind="overloaded"' in metrics and "kvgate_upstream_retries_total" in metrics
        assert states(front)[0] == "healthy"  # an overloaded upstream is not a broken one
    finally:
        front.stop()
        refusing.stop()
