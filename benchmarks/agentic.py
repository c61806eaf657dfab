"""Agentic multi-turn traffic over engine replicas sharing one KV pool, per routing policy.

Agents resend a long shared system prompt plus their whole growing history every turn, so
almost every token is input and almost all of it was seen before. S sessions start together,
each runs T turns in sequence (a turn waits for the previous answer, which joins the
history), on the real engine (`AsyncLLM`, tiny model, 2 replicas). Per routing policy, with
and without a per-session `cache_key`, and with prefix caching off, it reports:

- hit rate: cached prompt tokens / prompt tokens (token-weighted); the trace's ceiling is the
  share of prompt tokens whose K/V an earlier request had already computed;
- dup avoided: of those already-computed tokens, the share not computed again;
- TTFT p50 of first turns and of later turns, and cold/cached: later turns' TTFT p50 with
  prefix caching off divided by this run's;
- work CoV: coefficient of variation over replicas of the tokens each computed (the load
  the routing decides); in-flight CoV: the same over time-averaged requests in flight (also
  moved by how the replicas' threads share the CPU), and requests per replica.

    python benchmarks/agentic.py                  # 48 sessions x 12 turns, ~2 min on 2 cores
    python benchmarks/agentic.py --sessions 4 --turns 3 --system-tokens 512   # quick look
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvgate.engine import AsyncLLM, EngineConfig, SamplingParams  # noqa: E402
from kvgate.engine.core.block_hash import BLOCK_SIZE, block_hashes, root_hash  # noqa: E402
from kvgate.engine.request_options import RequestOptions

TOKEN_IDS = range(4, 260)  # ordinary byte-level tokens of the tiny model (no specials)
Trace = tuple[list[int], list[list[list[int]]]]  # system prompt; per session, per turn


@dataclass(frozen=True)
class Run:
    name: str
    routing: str
    caching: bool = True
    cache_key: bool = True  # each session sends its id as cache_key


RUNS = (
    Run("prefix", "prefix"),
    Run("prefix, no cache_key", "prefix", cache_key=False),
    Run("round_robin", "round_robin"),
    Run("random", "random"),
    Run("prefix, caching off", "prefix", caching=False),
)


@dataclass
class Turn:
    session: int
    turn: int
    prompt: list[int]
    output: list[int]
    cached_tokens: int
    replica: int
    submitted: float
    first_token: float
    finished: float

    @property
    def ttft(self) -> float:
        return self.first_token - self.submitted


def make_trace(args: argparse.Namespace) -> Trace:
    """The shared system prompt, and per session the tokens each turn adds (user/tool text)."""
    rng = random.Random(args.seed)
    system = rng.choices(TOKEN_IDS, k=args.system_tokens)
    low, high = args.turn_tokens
    turns = [
        [rng.choices(TOKEN_IDS, k=rng.randint(low, high)) for _ in range(args.turns)]
        for _ in range(args.sessions)
    ]
    return system, turns


async def run_session(
    engine: AsyncLLM,
    session: int,
    history: list[int],
    turns: list[list[int]],
    params: SamplingParams,
    cache_key: str | None,
) -> list[Turn]:
    done = []
    for index, added in enumerate(turns):
        prompt = history + added
        first, last = None, None
        submitted = time.perf_counter()
        async for out in engine.generate(prompt, params, RequestOptions(cache_key=cache_key)):
            first, last = first or time.perf_counter(), out
        finished = time.perf_counter()
        output = list(last.token_ids)
        done.append(
            Turn(
                session,
                index,
                prompt,
                output,
                last.cached_tokens,
                last.replica,
                submitted,
                first,
                finished,
            )
        )
        history = prompt + output
    return done


async def warm_up(engine: AsyncLLM, params: SamplingParams, replicas: int) -> None:
    """A few short requests at once, so every replica has stepped before the clock starts
    (shorter than a block: routed least-loaded, and nothing the trace could match)."""

    async def one(i: int) -> None:
        async for _ in engine.generate([TOKEN_IDS[-1 - i]] * (BLOCK_SIZE - 1), params):
            pass

    await asyncio.gather(*(one(i) for i in range(2 * replicas)))


async def run_trace(args: argparse.Namespace, run: Run, trace: Trace) -> tuple[list[Turn], float]:
    system, turns = trace
    config = EngineConfig(
        replicas=args.replicas,
        routing=run.routing,
        enable_prefix_caching=run.caching,
        kv_cache_memory=args.kv_cache_memory,
        seed=args.seed,
    )
    engine = AsyncLLM(config)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    try:
        await warm_up(engine, params, args.replicas)
        start = time.perf_counter()
        sessions = await asyncio.gather(
            *(
                run_session(
                    engine, s, system, turns[s], params, f"session-{s}" if run.cache_key else None
                )
                for s in range(args.sessions)
            )
        )
        wall = time.perf_counter() - start
    finally:
        engine.shutdown()
    return [turn for session in sessions for turn in session], wall


def repeated_tokens(turns: list[Turn]) -> int:
    """Prompt tokens (in full blocks) whose K/V an earlier-submitted request already computed:
    the most a cache could save, counting work two concurrent requests both did as waste."""
    root, seen, repeated = root_hash("agentic-bench", "any"), set(), 0
    for turn in sorted(turns, key=lambda t: t.submitted):
        hashes = block_hashes(turn.prompt, root, BLOCK_SIZE)
        shared = next((i for i, h in enumerate(hashes) if h not in seen), len(hashes))
        repeated += min(shared * BLOCK_SIZE, len(turn.prompt) - 1)  # the last token is redone
        # The final output token was sampled, never fed back, so it has no K/V.
        seen.update(block_hashes(turn.prompt + turn.output[:-1], root, BLOCK_SIZE))
    return repeated


def load_cov(turns: list[Turn], replicas: int, load: Callable[[Turn], float]) -> float:
    """Coefficient of variation over replicas of the summed per-request load."""
    totals = [0.0] * replicas
    for turn in turns:
        totals[turn.replica] += load(turn)
    return statistics.pstdev(totals) / statistics.fmean(totals)


def work(turn: Turn) -> float:
    """Tokens the replica computed for the request: uncached prompt, then the output."""
    return len(turn.prompt) - turn.cached_tokens + len(turn.output)


def in_flight(turn: Turn) -> float:
    """Seconds the request was queued or running (its share of the time-averaged load)."""
    return turn.finished - turn.submitted


def p50_ms(values: list[float]) -> float:
    return 1000 * statistics.median(values)


def summarize(turns: list[Turn], replicas: int) -> dict[str, float | str]:
    prompt = sum(len(t.prompt) for t in turns)
    cached = sum(t.cached_tokens for t in turns)
    repeated = repeated_tokens(turns)
    return {
        "hit rate": cached / prompt,
        "ceiling": repeated / prompt,
        "dup avoided": cached / repeated,
        "TTFT first ms": p50_ms([t.ttft for t in turns if t.turn == 0]),
        "TTFT later ms": p50_ms([t.ttft for t in turns if t.turn > 0]),
        "work CoV": load_cov(turns, replicas, work),
        "in-flight CoV": load_cov(turns, replicas, in_flight),
        "requests": "/".join(str(sum(t.replica == r for t in turns)) for r in range(replicas)),
        "input share": prompt / (prompt + sum(len(t.output) for t in turns)),
    }


COLUMNS = (
    "hit rate",
    "ceiling",
    "dup avoided",
    "TTFT first ms",
    "TTFT later ms",
    "cold/cached",
    "work CoV",
    "in-flight CoV",
    "requests",
)


def print_table(rows: list[tuple[Run, dict[str, float | str]]]) -> None:
    cold = next(stats["TTFT later ms"] for run, stats in rows if not run.caching)
    print(f"{'run':<22}" + "".join(f"{c:>15}" for c in COLUMNS))
    for run, stats in rows:
        stats["cold/cached"] = cold / stats["TTFT later ms"]
        cells = [v if isinstance(v, str) else f"{v:.3f}" for v in map(stats.get, COLUMNS)]
        print(f"{run.name:<22}" + "".join(f"{c:>15}" for c in cells))


def print_targets(stats: dict[str, float | str]) -> None:
    """The issue's targets, checked on the prefix-routing run."""
    checks = [("hit rate", ">=", 0.95), ("cold/cached", ">=", 5.0), ("work CoV", "<=", 0.1)]
    for name, op, target in checks:
        value = stats[name]
        ok = value >= target if op == ">=" else value <= target
        print(f"# target {name} {op} {target}: {value:.3f} {'met' if ok else 'NOT met'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sessions", type=int, default=48)
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--system-tokens", type=int, default=2048)
    parser.add_argument(
        "--turn-tokens",
        type=int,
        nargs=2,
        default=(64, 128),
        metavar=("MIN", "MAX"),
        help="tokens each turn adds (uniform)",
    )
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    trace = make_trace(args)
    rows = []
    for run in RUNS:
        turns, wall = asyncio.run(run_trace(args, run, trace))
        rows.append((run, summarize(turns, args.replicas)))
        print(f"# {run.name}: {len(turns)} requests in {wall:.1f}s", file=sys.stderr)
    low, high = args.turn_tokens
    print(
        f"# {args.sessions} sessions x {args.turns} turns on {args.replicas} replicas, "
        f"system prompt {args.system_tokens} tokens, +{low}..{high} tokens/turn, "
        f"{args.output_tokens} output tokens; input share {rows[0][1]['input share']:.3f}"
    )
    print_table(rows)
    print_targets(rows[0][1])
    command = sys.argv[1:] if argv is None else argv
    print("# command: python benchmarks/agentic.py " + " ".join(command))


if __name__ == "__main__":
    main()
