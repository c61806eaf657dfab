"""Precise routing with real processes: three kvgate upstreams publishing KV-cache events
(``--kv-events-config``) and a fleet gateway following them (``--upstream-kv-events``).

Prompts are token ids, so the gateway needs no tokenizer. A prompt's blocks are put on an
upstream the hash would not pick (sent there directly); the gateway then sends a longer
prompt sharing that prefix where the blocks are. A gateway started afterwards rebuilds its
index by replay; an upstream restarted drops its subscription (hash routing meanwhile), and
precise routing resumes once its new events arrive.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.core.block_hash import block_hashes
from gateway.upstream.routing import ROOT, Load, UpstreamRouter
from tests.gateway.live_server import free_port
from tests.gateway.upstream.processes import Process, gateway, running

PREFIX_TOKENS = 160  # ten 16-token blocks


def kv_flags(pub: int, replay: int) -> tuple[str, ...]:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv-events",
    }
    return ("--kv-events-config", json.dumps(config))


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("precise")


@pytest.fixture(scope="module")
def ports() -> list[tuple[int, int]]:
    return [(free_port(), free_port()) for _ in range(3)]


@pytest.fixture(scope="module")
def upstreams(log_dir: Path, ports: list[tuple[int, int]]) -> Iterator[list[Process]]:
    with running([Process(log_dir, *kv_flags(*p)) for p in ports]) as started:
        yield started


def follow(upstreams: list[Process], ports: list[tuple[int, int]]) -> list[str]:
    flags = []
    for upstream, (pub, replay) in zip(upstreams, ports, strict=True):
        spec = f"{upstream.base}=tcp://127.0.0.1:{pub},replay=tcp://127.0.0.1:{replay}"
        flags += ["--upstream-kv-events", spec + ",topic=kv-events"]
    return flags


def complete(base: str, prompt: list[int]) -> str:
    """Send a completion of token ids; the upstream that served it."""
    body = {"model": "tiny-model-v3", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    response = httpx.post(base + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.headers.get("x-kvgate-upstream", base)


def hash_pick(urls: list[str], prompt: list[int]) -> int:
    router = UpstreamRouter(urls)
    hashes = block_hashes(prompt[: 8 * 16], ROOT)
    return router.choose(hashes, None, [Load(0)] * len(urls), [True] * len(urls))[0]


def decisions(g: Process, rule: str) -> float:
    found = re.search(rf'kvgate_routing_decisions_total{{rule="{rule}"}} (\S+)', g.metrics())
    return float(found.group(1)) if found else 0.0


def placed_prefix(seed: int, upstreams: list[Process]) -> tuple[list[int], int]:
    """A prefix whose hash picks one upstream, put on the next one (sent there directly)."""
    urls = [u.base for u in upstreams]
    prefix = [(seed * 7919 + n * 31) % 500 + 3 for n in range(PREFIX_TOKENS)]
    target = (hash_pick(urls, prefix) + 1) % len(urls)
    complete(urls[target], prefix)
    return prefix, target


def wait_precise(g: Process, before: float, prompt: list[int], target: str) -> None:
    """Calls sharing the prefix go to ``target`` once its events have arrived."""
    deadline = time.monotonic() + 10
    while True:
        served = complete(g.base, prompt)
        if served == target and decisions(g, "precise") > before:
            return
        assert time.monotonic() < deadline, f"served by {served}, not {target}"
        time.sleep(0.2)


def test_a_shared_prefix_goes_where_its_blocks_are_and_survives_a_restart(
    log_dir: Path, upstreams: list[Process], ports: list[tuple[int, int]]
) -> None:
    urls = [u.base for u in upstreams]
    first = gateway(log_dir, upstreams, *follow(upstreams, ports))
    with running([first], 60):
        for seed in range(3):
            prefix, target = placed_prefix(seed, upstreams)
            before = decisions(first, "precise")
            wait_precise(first, before, prefix + [seed + 1] * 20, urls[target])
    prefix, target = placed_prefix(5, upstreams)
    time.sleep(0.5)  # its events are published before the next gateway starts
    restarted = gateway(log_dir, upstreams, *follow(upstreams, ports))
    with running([restarted], 60):
        time.sleep(1.0)  # connected and replayed: the index follows readiness closely
        assert complete(restarted.base, prefix + [9] * 20) == urls[target]  # replayed
        assert decisions(restarted, "precise") == 1


def test_a_dropped_subscription_falls_back_to_hashing_and_recovers(
    log_dir: Path, upstreams: list[Process], ports: list[tuple[int, int]]
) -> None:
    urls = [u.base for u in upstreams]
    g = gateway(log_dir, upstreams, *follow(upstreams, ports))
    with running([g], 60):
        prefix, target = placed_prefix(11, upstreams)
        wait_precise(g, decisions(g, "precise"), prefix + [1] * 20, urls[target])
        upstreams[target].stop()  # its publisher goes with it: the subscription drops
        upstreams[target].start().wait_ready()  # an empty cache: nothing precise to say
        time.sleep(1.0)
        before = decisions(g, "precise")
        assert complete(g.base, prefix + [2] * 20) == urls[hash_pick(urls, prefix)]
        assert decisions(g, "precise") == before
        prefix, target = placed_prefix(12, upstreams)  # events from the restarted one too
        wait_precise(g, decisions(g, "precise"), prefix + [3] * 20, urls[target])
