"""Soak: closed-loop mixed traffic against a live kvgate, then an audit of what it left behind.

Workers call ``generate`` and ``chat`` over HTTP back to back, with random prompt and output
lengths, JSON or SSE; about 20% walk away mid-call, a few ask for more than the limits allow,
and some share one API key so the per-client limit answers 429. The server runs in this process
(its own thread and event loop), so at the end the KV block pool itself is checked. It passes
only if every answer was a well-formed JSON-RPC message (schema-checked) with an expected
status (200, or the intended 503/429 with Retry-After), ``check_invariants()`` holds and every
block is free or evictable. Prints one JSON object:

    python benchmarks/soak.py --duration 600
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import uvicorn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.loopback import free_port  # noqa: E402
from kvgate.engine import AsyncLLM, EngineConfig  # noqa: E402
from kvgate.gateway.app import create_app  # noqa: E402
from kvgate.gateway.cli import engine_limits  # noqa: E402
from kvgate.gateway.http.serving import http_protocol  # noqa: E402
from kvgate.gateway.settings import Settings  # noqa: E402
from kvgate.schemas.mcp_wire import MODERN_WIRE, validate_server_message  # noqa: E402

WORDS = (
    "the a of KV cache block token prefix replica stream model gate soak load long short".split()
)
EXPECTED = {200, 429, 503}
SHARED_KEY_WORKERS = 4  # workers 0..3 share one API key: with a per-client limit of 2, 429s


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)  # completed calls, seconds
    tokens: int = 0
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        self.outcomes["malformed"] += 1
        if len(self.problems) < 20:
            self.problems.append(text)


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def make_call(
    rng: random.Random, worker: int, request_id: int
) -> tuple[dict[str, Any], dict[str, str], str]:
    """A random tools/call: (body, headers, kind) with kind ok | over_limit."""
    tool = rng.choice(("generate", "chat"))
    kind = "over_limit" if rng.random() < 0.05 else "ok"
    words, max_tokens = rng.randint(1, 200), rng.randint(1, 96)  # < 1024 tokens with a template
    if kind == "over_limit":  # a prompt past --max-prompt-tokens, or max_tokens past its limit
        if rng.random() < 0.5:
            words = rng.randint(2000, 3000)
        else:
            max_tokens = rng.randint(129, 100_000)
    text = " ".join(rng.choices(WORDS, k=words))
    sampling = {
        "max_tokens": max_tokens,
        "temperature": rng.choice((0, 0.8)),
        "seed": rng.randint(0, 9),
    }
    if tool == "generate":
        arguments: dict[str, Any] = {"prompt": text, **sampling}
    else:
        arguments = {"messages": [{"role": "user", "content": text}], **sampling}
    meta: dict[str, Any] = {
        "io.modelcontextprotocol/protocolVersion": MODERN_WIRE,
        "io.modelcontextprotocol/clientCapabilities": {},
    }
    if rng.random() < 0.5:
        meta["progressToken"] = f"w{worker}-{request_id}"
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": MODERN_WIRE,
        "Mcp-Method": "tools/call",
        "Mcp-Name": tool,
    }
    if worker < SHARED_KEY_WORKERS:
        headers["Authorization"] = "Bearer soak-shared-key"
    body = {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "tools/call",
        "params": {"name": tool, "arguments": arguments, "_meta": meta},
    }
    return body, headers, kind


def check_final(
    tally: Tally,
    message: dict[str, Any],
    request_id: int,
    status: int,
    retry_after: str | None,
    kind: str,
    started: float,
) -> None:
    """Judge the JSON-RPC response that ends a call."""
    if message.get("id") != request_id:
        tally.problem(f"id {message.get('id')!r} != {request_id}")
        return
    if "error" in message:
        code = message["error"]["code"]
        if status in (429, 503) or code in (-31000, -31001):
            if code not in (-31000, -31001) or not retry_after:
                tally.problem(f"refusal {status} code {code} Retry-After {retry_after!r}")
            else:
                tally.outcomes["rejected_429" if code == -31001 else "rejected_503"] += 1
            return
        tally.problem(f"unexpected error {status} {message['error']}")
        return
    result = message["result"]
    if result.get("isError"):
        text = result["content"][0]["text"]
        if kind == "over_limit" and "Invalid arguments" in text:
            tally.outcomes["over_limit_tool_error"] += 1
        else:
            tally.problem(f"tool error on a valid call: {text[:200]}")
        return
    if kind == "over_limit":
        tally.problem("an over-limit call succeeded")
        return
    tally.outcomes["completed"] += 1
    tally.latencies.append(time.perf_counter() - started)
    tally.tokens += result["structuredContent"]["completion_tokens"]


async def one_call(
    http: httpx.AsyncClient,
    url: str,
    rng: random.Random,
    worker: int,
    request_id: int,
    tally: Tally,
) -> float:
    """One call, judged into ``tally``; returns the Retry-After it was told (0 if none)."""
    body, headers, kind = make_call(rng, worker, request_id)
    cancel_after = rng.randint(1, 4) if rng.random() < 0.2 else None  # events (SSE) or steps
    streaming = "progressToken" in body["params"]["_meta"]
    exchange = exchange_once(
        http, url, body, headers, kind, tally, None if not streaming else cancel_after
    )
    if streaming or cancel_after is None:
        return await exchange
    try:  # a JSON call given up on by a client that stops waiting
        return await asyncio.wait_for(exchange, timeout=0.05 * cancel_after)
    except TimeoutError:
        tally.outcomes["cancelled"] += 1
        return 0.0


async def exchange_once(
    http: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    kind: str,
    tally: Tally,
    cancel_after: int | None,
) -> float:
    """Send, read and judge one call (an SSE one is left after ``cancel_after`` events)."""
    request_id = body["id"]
    started = time.perf_counter()
    async with http.stream("POST", url, content=orjson.dumps(body), headers=headers) as response:
        status = response.status_code
        tally.statuses[status] += 1
        if status not in EXPECTED:
            tally.problem(f"status {status}")
            return 0.0
        retry_after = response.headers.get("retry-after")
        backoff = float(retry_after) if retry_after and retry_after.isdigit() else 0.0
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            seen = 0
            buffer = b""
            async for chunk in response.aiter_bytes():
                buffer += chunk
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    data = [line[5:] for line in event.split(b"\n") if line.startswith(b"data:")]
                    if not data:
                        continue
                    message = orjson.loads(b"\n".join(data))
                    validate_server_message(MODERN_WIRE, message, "tools/call")
                    if "method" not in message:
                        check_final(tally, message, request_id, status, retry_after, kind, started)
                        return backoff
                    seen += 1
                    if cancel_after is not None and seen >= cancel_after:
                        tally.outcomes["cancelled"] += 1
                        return 0.0  # leaving the block closes the connection mid-stream
            tally.problem("stream ended without a response")
            return 0.0
        message = orjson.loads(await response.aread())
        validate_server_message(MODERN_WIRE, message, "tools/call")
        check_final(tally, message, request_id, status, retry_after, kind, started)
        return backoff


async def worker_loop(url: str, worker: int, seed: int, stop_at: float, tally: Tally) -> None:
    rng = random.Random(seed * 1000 + worker)
    limits = httpx.Limits(max_connections=4, max_keepalive_connections=2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        request_id = 0
        while time.monotonic() < stop_at:
            request_id += 1
            try:
                backoff = await one_call(http, url, rng, worker, request_id, tally)
                if backoff:  # a well-behaved client honours Retry-After (capped for the soak)
                    await asyncio.sleep(min(backoff, 1.0) * rng.uniform(0.5, 1.0))
            except Exception as exc:  # noqa: BLE001 - a soak records every failure, then goes on
                tally.problem(f"{type(exc).__name__}: {exc}"[:300])


class InProcessServer:
    """kvgate (app + engine) on a free port, served from a background thread."""

    def __init__(self, engine: AsyncLLM, settings: Settings) -> None:
        self.app = create_app(settings, engine)
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=settings.port,
            log_level="error",
            access_log=False,
            http=http_protocol(settings),
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{settings.port}/mcp"

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("kvgate did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def wait_idle(engine: AsyncLLM, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and engine.core.pool.num_in_use() == 0:
            return True
        time.sleep(0.05)
    return False


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] if ordered else float("nan")


async def drive(url: str, args: argparse.Namespace, tally: Tally) -> tuple[float, float]:
    """Run the workers; returns (elapsed seconds, RSS in MiB once warmed up: 10% in)."""
    stop_at = time.monotonic() + args.duration
    started = time.monotonic()
    workers = asyncio.gather(
        *(worker_loop(url, w, args.seed, stop_at, tally) for w in range(args.concurrency))
    )
    await asyncio.sleep(args.duration / 10)
    warm_rss = rss_mib()
    await workers
    return time.monotonic() - started, warm_rss


def run_soak(args: argparse.Namespace) -> dict[str, Any]:
    settings = Settings(
        port=free_port(),
        max_waiting=args.max_waiting,
        max_prompt_tokens=1024,
        max_tokens_limit=128,
        max_concurrency_per_client=2,
        request_timeout_s=120,
    )
    engine = AsyncLLM(
        EngineConfig(
            kv_cache_memory=args.kv_cache_memory,
            replicas=args.replicas,
            max_num_seqs=args.max_num_seqs,
            **engine_limits(settings),
        )
    )
    tally = Tally()
    try:
        with InProcessServer(engine, settings) as server:
            rss_start = rss_mib()
            elapsed, rss_warm = asyncio.run(drive(server.url, args, tally))
            rss_end = rss_mib()
            idle = wait_idle(engine)
            engine.core.pool.check_invariants()  # raises AssertionError on any inconsistency
            in_use = engine.core.pool.num_in_use()
            cached = engine.core.pool.num_cached()
    finally:
        engine.shutdown()
    completed = tally.outcomes["completed"]
    calls = sum(tally.outcomes.values())
    admitted = calls - tally.outcomes["rejected_429"] - tally.outcomes["rejected_503"]
    unexpected = {s: n for s, n in tally.statuses.items() if s not in EXPECTED}
    return {
        "duration_s": round(elapsed, 1),
        "concurrency": args.concurrency,
        "calls": calls,
        "outcomes": dict(tally.outcomes),
        "statuses": {str(k): v for k, v in sorted(tally.statuses.items())},
        "cancelled_share_of_admitted": round(tally.outcomes["cancelled"] / max(admitted, 1), 3),
        "throughput_calls_per_s": round(completed / elapsed, 2),
        "throughput_tokens_per_s": round(tally.tokens / elapsed, 1),
        "latency_p50_ms": round(1000 * percentile(tally.latencies, 0.5), 1),
        "latency_p99_ms": round(1000 * percentile(tally.latencies, 0.99), 1),
        "rss_start_mib": round(rss_start, 1),
        "rss_warm_mib": round(rss_warm, 1),
        "rss_end_mib": round(rss_end, 1),
        "rss_growth_after_warmup_mib": round(rss_end - rss_warm, 1),
        "engine_idle": idle,
        "blocks_in_use": in_use,
        "blocks_cached": cached,
        "invariants": "ok",
        "problems": tally.problems,
        "passed": idle and in_use == 0 and not tally.problems and not unexpected and completed > 0,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop workers")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=4, help="running per replica")
    parser.add_argument(
        "--max-waiting", type=int, default=4, help="waiting per replica (503 beyond)"
    )
    parser.add_argument("--kv-cache-memory", default="16MiB")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    report = run_soak(parse_args(argv))
    print(json.dumps(report, indent=2))
    sys.exit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
