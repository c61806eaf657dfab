"""Prefix hits through nginx and 3 kvgate processes: cache-key hashing vs round robin.

Each kvgate process has its own KV pool, so a conversation reuses its cached prefix only when
its turns keep reaching the same process. Agents resend a shared system prompt plus their whole
growing history every turn. S sessions run at once, T turns each (a turn waits for the
previous answer, which joins the history); every turn is one `generate` tools/call through
nginx (examples/deploy/nginx.conf). Two runs, each on its own system prompt (so neither
reuses the other's cache):

- cache-key hashing: each call carries `cache_key` = the session id, and the matching
  `Mcp-Param-Cache-Key` header nginx hashes on (consistent);
- round robin: no key, so nginx spreads the calls over the three processes.

Reported per run: token-weighted hit rate (sum cached_tokens / sum prompt_tokens, from each
result's structuredContent) over all turns and over turns 2+, the ceiling of the latter (the
previous turn's prompt is a prefix of this one's); the hit rate on session tokens only (those
after the shared system prompt, which every process soon caches whatever the routing: this is
where routing matters); processes each session touched, and wall time. `hashing / round robin`
compares hit rates measured in the same run.

    python benchmarks/deploy_agentic.py            # starts Redis, 3 kvgate, nginx (run-local.sh)
    python benchmarks/deploy_agentic.py --sessions 6 --turns 4       # quicker
    python benchmarks/deploy_agentic.py --url http://127.0.0.1:18100/mcp   # a running deployment
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
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
RUN_LOCAL = ROOT / "examples" / "deploy" / "run-local.sh"
PROTOCOL = "2026-07-28"
WORDS = (
    "agent tool call result plan step file read write search query answer check test "
    "build deploy cache token model prompt user system context memory error retry next "
    "value list item state update review report summary task goal branch merge"
).split()


@dataclass
class Turn:
    prompt_tokens: int
    cached_tokens: int
    upstream: str


@dataclass
class RunResult:
    name: str
    system_tokens: int
    sessions: list[list[Turn]] = field(default_factory=list)
    wall_s: float = 0.0

    def session_hit_rate(self) -> float:
        """Cached tokens beyond the system prompt / prompt tokens beyond it, turns 2+."""
        turns = [t for s in self.sessions for t in s[1:]]
        cached = sum(max(0, t.cached_tokens - self.system_tokens) for t in turns)
        return cached / max(1, sum(t.prompt_tokens - self.system_tokens for t in turns))

    def hit_rate(self, first_turn: int = 0) -> float:
        turns = [t for s in self.sessions for t in s[first_turn:]]
        return sum(t.cached_tokens for t in turns) / max(1, sum(t.prompt_tokens for t in turns))

    def computed_tokens(self) -> int:
        """Prompt tokens some process had to prefill (not found in its cache)."""
        return sum(t.prompt_tokens - t.cached_tokens for s in self.sessions for t in s)

    def ceiling(self) -> float:
        """Turns 2+: the previous turn's prompt is a prefix of this one's, so at most that."""
        reusable = sum(s[i - 1].prompt_tokens for s in self.sessions for i in range(1, len(s)))
        total = sum(t.prompt_tokens for s in self.sessions for t in s[1:])
        return reusable / max(1, total)

    def processes_per_session(self) -> float:
        return statistics.mean(len({t.upstream for t in s}) for s in self.sessions)


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choices(WORDS, k=count))


def request(prompt: str, max_tokens: int, cache_key: str | None) -> tuple[bytes, dict[str, str]]:
    arguments: dict[str, object] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": PROTOCOL,
        "Mcp-Method": "tools/call",
        "Mcp-Name": "generate",
    }
    if cache_key is not None:
        arguments["cache_key"] = cache_key
        headers["Mcp-Param-Cache-Key"] = cache_key
    meta = {
        "io.modelcontextprotocol/protocolVersion": PROTOCOL,
        "io.modelcontextprotocol/clientInfo": {"name": "deploy_agentic", "version": "1.0"},
        "io.modelcontextprotocol/clientCapabilities": {},
    }
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "generate", "arguments": arguments, "_meta": meta},
    }
    return orjson.dumps(body), headers


async def session(
    http: httpx.AsyncClient,
    url: str,
    system: str,
    user_turns: list[str],
    key: str | None,
    max_tokens: int,
) -> list[Turn]:
    history, turns = "", []
    for text in user_turns:
        history += f"\nUser: {text}\nAssistant:"
        content, headers = request(system + history, max_tokens, key)
        response = await http.post(url, content=content, headers=headers)
        response.raise_for_status()
        result = response.json()["result"]
        if result.get("isError"):
            raise RuntimeError(result["content"][0]["text"])
        structured = result["structuredContent"]
        turns.append(
            Turn(
                structured["prompt_tokens"],
                structured["cached_tokens"],
                response.headers.get("x-kvgate-upstream", "?"),
            )
        )
        history += structured["text"]
    return turns


async def count_tokens(http: httpx.AsyncClient, url: str, text: str) -> int:
    content, headers = request(text, 1, None)
    body = orjson.loads(content)
    body["params"].update(name="tokenize", arguments={"text": text})
    headers["Mcp-Name"] = "tokenize"
    response = await http.post(url, content=orjson.dumps(body), headers=headers)
    response.raise_for_status()
    return response.json()["result"]["structuredContent"]["count"]


async def run(name: str, hashing: bool, args: argparse.Namespace) -> RunResult:
    rng = random.Random(f"{args.seed}-{name}")  # each run its own system prompt and turns
    system = f"System ({name}): " + words(rng, args.system_words)
    low, high = args.turn_words
    trace = [
        [words(rng, rng.randint(low, high)) for _ in range(args.turns)]
        for _ in range(args.sessions)
    ]
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as http:
        result = RunResult(name, await count_tokens(http, args.url, system))
        began = time.perf_counter()
        result.sessions = await asyncio.gather(
            *(
                session(
                    http,
                    args.url,
                    system,
                    turns,
                    f"{name}-session-{i}" if hashing else None,
                    args.max_tokens,
                )
                for i, turns in enumerate(trace)
            )
        )
        result.wall_s = time.perf_counter() - began
    return result


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "inf"


def report(results: list[RunResult], args: argparse.Namespace) -> None:
    print(
        f"\n{args.sessions} sessions x {args.turns} turns through nginx ({args.url}), "
        f"system prompt {args.system_words} words, {args.turn_words[0]}-{args.turn_words[1]} "
        f"words per turn, {args.max_tokens} tokens per answer\n"
    )
    print(
        "| routing | hit rate | turns 2+ | ceiling, turns 2+ | session tokens, turns 2+ "
        "| tokens prefilled | processes per session | wall s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        print(
            f"| {r.name} | {r.hit_rate():.3f} | {r.hit_rate(1):.3f} | {r.ceiling():.3f} | "
            f"{r.session_hit_rate():.3f} | {r.computed_tokens()} | "
            f"{r.processes_per_session():.2f} | {r.wall_s:.1f} |"
        )
    hashing, round_robin = results
    print(
        f"\nhashing / round robin: hit rate {ratio(hashing.hit_rate(), round_robin.hit_rate())}, "
        f"turns 2+ {ratio(hashing.hit_rate(1), round_robin.hit_rate(1))}, session tokens "
        f"{ratio(hashing.session_hit_rate(), round_robin.session_hit_rate())}; round robin "
        f"prefilled {ratio(round_robin.computed_tokens(), hashing.computed_tokens())} the "
        f"tokens (system prompt: {hashing.system_tokens} tokens)"
    )
    print("command: python benchmarks/deploy_agentic.py " + " ".join(sys.argv[1:]))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--url",
        default=os.environ.get("KVGATE_MCP_URL"),
        help="nginx's /mcp (default: start a deployment with run-local.sh)",
    )
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-words", type=int, default=300)
    parser.add_argument("--turn-words", type=int, nargs=2, default=(30, 60))
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.url is None:  # bring the deployment up around this very command, then tear it down
        command = [
            str(RUN_LOCAL),
            "--",
            sys.executable,
            str(Path(__file__).resolve()),
            *sys.argv[1:],
        ]
        sys.exit(subprocess.run(command, check=False).returncode)
    results = [
        asyncio.run(run("hashing", True, args)),
        asyncio.run(run("round robin", False, args)),
    ]
    report(results, args)


if __name__ == "__main__":
    main()
