"""Precise routing with real processes: three kvgate upstreams publishing KV-cache events
(``--kv-events-config``) and a fleet gateway following them (``--upstream-kv-events``).

Prompts are token ids, or text and conversations the gateway (without ``--tokenizer``) has
the upstreams' ``/tokenize`` count. A prompt's blocks are put on an
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
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.engine.core.block_hash import block_hashes
from kvgate.engine.sampling_params import SamplingParams
from kvgate.gateway.generation import GenerationRequest
from kvgate.gateway.upstream.routing import ROOT, Load, PrefixKeys, UpstreamRouter
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


def complete(base: str, prompt: list[int] | str | list[dict[str, Any]]) -> str:
    """Send a completion (token ids, text) or a chat (a list of messages); the upstream that
    served it."""
    body: dict[str, Any] = {"model": "tiny-model-v3", "max_tokens": 1, "temperature": 0}
    path = "/v1/completions"
    if prompt and isinstance(prompt[0], dict):
        path, body["messages"] = "/v1/chat/completions", prompt
    else:
        body["prompt"] = prompt
    response = httpx.post(base + path, json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.headers.get("x-kvgate-upstream", base)


def hash_pick(urls: list[str], prompt: list[int] | str | list[dict[str, Any]]) -> int:
    """The upstream hash routing gives the prompt (by its text when not token ids)."""
    router = UpstreamRouter(urls)
    if prompt and isinstance(prompt[0], int):
        hashes = block_hashes(prompt[: 8 * 16], ROOT)
    else:
        request = GenerationRequest(SamplingParams(), prompt=prompt)
        if isinstance(prompt, list):
            request = GenerationRequest(SamplingParams(), messages=prompt)
        hashes = PrefixKeys(None)(request)
    return router.choose(hashes, None, [Load(0)] * len(urls), [True] * len(urls))[0]


def decisions(g: Process, rule: str) -> float:
    found = re.search(rf'kvgate_routing_decisions_total{{rule="{rule}"}} (\S+)', g.metrics())
    return float(found.group(1)) if found else 0.0


def subscription(g: Process, name: str, url: str, kind: str | None = None) -> float:
    """A ``kvgate_upstream_kv_*`` sample of ``url``'s subscription."""
    for family in text_string_to_metric_families(g.metrics()):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == name and labels["url"] == url and labels.get("kind") == kind:
                assert labels["upstream"].isdigit()
                return sample.value
    raise AssertionError(f"no {name} for {url}")


def indexed(g: Process, url: str) -> float:
    return subscription(g, "kvgate_upstream_kv_index_blocks", url)


def place(g: Process, url: str, prompt: list[int] | str | list[dict[str, Any]]) -> None:
    """Send ``prompt`` to ``url`` directly and wait until ``g`` has indexed its blocks: a call
    through ``g`` before then is routed by hash, and its blocks would then be held twice."""
    held = indexed(g, url)
    complete(url, prompt)
    deadline = time.monotonic() + 20
    while indexed(g, url) < held + PREFIX_TOKENS // 16:
        assert time.monotonic() < deadline, f"{url}'s events never reached the gateway"
        time.sleep(0.05)


def placed_prefix(seed: int, upstreams: list[Process], g: Process) -> tuple[list[int], int]:
    """A prefix whose hash picks one upstream, put on the next one (sent there directly)."""
    urls = [u.base for u in upstreams]
    prefix = [(seed * 7919 + n * 31) % 500 + 3 for n in range(PREFIX_TOKENS)]
    target = (hash_pick(urls, prefix) + 1) % len(urls)
    place(g, urls[target], prefix)
    return prefix, target


def wait_precise(
    g: Process, before: float, prompt: list[int] | str | list[dict[str, Any]], target: str
) -> None:
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
            prefix, target = placed_prefix(seed, upstreams, first)
            before = decisions(first, "precise")
            wait_precise(first, before, prefix + [seed + 1] * 20, urls[target])
        prefix, target = placed_prefix(5, upstreams, first)  # indexed: published
    restarted = gateway(log_dir, upstreams, *follow(upstreams, ports))
    with running([restarted], 60):
        deadline = time.monotonic() + 20
        while indexed(restarted, urls[target]) < PREFIX_TOKENS // 16:  # replayed
            assert time.monotonic() < deadline, "the restarted gateway never replayed"
            time.sleep(0.05)
        assert complete(restarted.base, prefix + [9] * 20) == urls[target]  # replayed
        assert decisions(restarted, "precise") == 1
        url = urls[target]
        assert subscription(restarted, "kvgate_upstream_kv_events_total", url, "replayed") > 0
        assert subscription(restarted, "kvgate_upstream_kv_index_blocks", url) >= 10
        assert subscription(restarted, "kvgate_upstream_kv_events_live", url) == 1


def test_a_dropped_subscription_falls_back_to_hashing_and_recovers(
    log_dir: Path, upstreams: list[Process], ports: list[tuple[int, int]]
) -> None:
    urls = [u.base for u in upstreams]
    g = gateway(log_dir, upstreams, *follow(upstreams, ports))
    with running([g], 60):
        prefix, target = placed_prefix(11, upstreams, g)
        wait_precise(g, decisions(g, "precise"), prefix + [1] * 20, urls[target])
        upstreams[target].stop()  # its publisher goes with it: the subscription drops
        upstreams[target].start().wait_ready()  # an empty cache: nothing precise to say
        time.sleep(1.0)
        before = decisions(g, "precise")
        assert complete(g.base, prefix + [2] * 20) == urls[hash_pick(urls, prefix)]
        assert decisions(g, "precise") == before
        lost = subscription(g, "kvgate_upstream_kv_events_total", urls[target], "disconnected")
        assert lost == 1
        prefix, target = placed_prefix(12, upstreams, g)  # events from the restarted one too
        wait_precise(g, decisions(g, "precise"), prefix + [3] * 20, urls[target])


def test_text_and_chat_route_precisely_on_the_upstreams_own_tokens(
    log_dir: Path, upstreams: list[Process], ports: list[tuple[int, int]]
) -> None:
    """No --tokenizer: the gateway asks an upstream's /tokenize (``messages`` for a chat, so
    the upstream's own template renders it), and no routing decision counts that."""
    urls = [u.base for u in upstreams]
    text = " ".join(f"step {n}: read the file, then patch line {n * 7 % 50}." for n in range(40))
    system = {"role": "system", "content": text}
    g = gateway(log_dir, upstreams, *follow(upstreams, ports))
    with running([g], 60):
        for prompt, longer in (
            (text, text + " Now run the tests."),
            (
                [system, {"role": "user", "content": "fix the build"}],
                [system, {"role": "user", "content": "fix the build, then the docs"}],
            ),
        ):
            target = (hash_pick(urls, prompt) + 1) % len(urls)
            place(g, urls[target], prompt)
            wait_precise(g, decisions(g, "precise"), longer, urls[target])
        assert decisions(g, "least_loaded") == 0  # asking /tokenize is no call
