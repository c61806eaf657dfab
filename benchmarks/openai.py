"""kvgate's ``/v1/chat/completions`` against vLLM's CPU OpenAI server, same model, same machine.

    python -m benchmarks.openai [--vllm-python PATH] [--model DIR] [--rounds 3]
                                [--requests 24] [--prompt-words 200] [--max-tokens 64]

Both servers serve the same Hugging Face folder (default: kvgate's tiny model) in the same
dtype (bf16 where the CPU computes it natively, else fp32). Each round measures each server in
turn, at concurrency 1 and 16, with streamed chat completions (greedy, ``ignore_eos`` so every
answer has ``--max-tokens`` tokens, distinct prompts so the prefix cache does not decide it):
output tokens/s over the wall time, TTFT p50/p99 and inter-token latency p50 (from the chunks'
arrival times), and the server's CPU time per output token (all its processes' user + system
time over the measurement, from /proc: a figure a busy machine disturbs far less than wall
times). Prints one line per (server, concurrency), kvgate/vLLM ratios per round (the two
servers measured minutes apart: the fair pairing where rounds vary) and of each server's best
round (by throughput). Without ``--vllm-python`` only kvgate is measured.

``--vllm-bench`` measures with vLLM's own client instead (``vllm.benchmarks.serve`` from the
``--vllm-python`` venv, a client neither project's server code wrote): its random dataset,
``--random-input-len`` 256 -> ``--random-output-len`` 128 tokens, ``--num-prompts`` 64 at
``--concurrency`` 16, on ``/v1/completions``, ``ignore_eos``; the ITL column is then its
median TPOT.

While each measurement runs, a prober times the light endpoints every ``--probe-ms``: ``GET
/v1/models`` on both servers and MCP ``tools/list`` on kvgate (vLLM has no MCP endpoint),
reported as p99 under load beside the same probe's p99 on the idle server just before: a
server busy generating must still answer health checks, catalogues and discovery promptly.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

# Run as a script, this file's folder would lead sys.path (and this module would shadow the
# `openai` package): the repository root takes its place.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from benchmarks import record  # noqa: E402
from benchmarks.loopback import free_port, stop  # noqa: E402
from benchmarks.mcp import request_parts  # noqa: E402
from benchmarks.vllm_peer import peer_environment  # noqa: E402
from kvgate.engine.config import native_bf16_flags  # noqa: E402
from kvgate.engine.loading.tiny_model import default_model_dir  # noqa: E402

WORDS = "the model reads a long prompt and answers it one token at a time".split()


@dataclass
class Figures:
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    tokens: int
    cpu_ms_per_token: float = float("nan")
    probes_p99_ms: dict[str, float] = field(default_factory=dict)

    def line(self) -> str:
        probes = "".join(f"  {path} p99 {ms:5.1f} ms" for path, ms in self.probes_p99_ms.items())
        return (
            f"{self.tokens_per_s:8.1f} tok/s  TTFT p50 {self.ttft_p50_ms:7.1f} ms  "
            f"p99 {self.ttft_p99_ms:7.1f} ms  ITL p50 {self.itl_p50_ms:6.2f} ms  "
            f"CPU {self.cpu_ms_per_token:5.2f} ms/token{probes}"
        )


class Prober:
    """Times ``GET /v1/models`` (and MCP ``tools/list`` where the server has MCP) from a thread
    of its own, one probe every ``interval_s``, over one keep-alive connection each, as a load
    balancer's health check or an agent's discovery would arrive beside the load."""

    def __init__(self, base: str, mcp: bool, interval_s: float) -> None:
        headers, body = request_parts("tools/list")
        self._probes: dict[str, Callable[[httpx.Client], httpx.Response]] = {
            "/v1/models": lambda client: client.get(base + "/v1/models"),
        }
        if mcp:
            self._probes["tools/list"] = lambda client: client.post(
                base + "/mcp", content=body, headers=headers
            )
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: Exception | None = None
        self.latencies: dict[str, list[float]] = {name: [] for name in self._probes}

    def _run(self) -> None:
        clients = {name: httpx.Client(timeout=30) for name in self._probes}
        try:
            while not self._stop.wait(self._interval_s):
                for name, probe in self._probes.items():
                    started = time.perf_counter()
                    response = probe(clients[name])
                    if response.status_code != 200:
                        raise RuntimeError(f"{name}: HTTP {response.status_code}")
                    self.latencies[name].append(time.perf_counter() - started)
        except Exception as exc:  # noqa: BLE001 - raised in the measuring thread by __exit__
            self._failure = exc
        finally:
            for client in clients.values():
                client.close()

    def __enter__(self) -> Prober:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        if self._failure is not None:  # a probe that failed must not leave a p99 of the rest
            raise RuntimeError(f"light-endpoint probe failed: {self._failure}")

    def p99_ms(self) -> dict[str, float]:
        return {name: 1000 * percentile(values, 0.99) for name, values in self.latencies.items()}


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and every process below it (from /proc)."""
    total, pending = 0.0, [pid]
    while pending:
        current = pending.pop()
        try:
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(") ", 1)[1].split()
            for task in Path(f"/proc/{current}/task").glob("*/children"):
                pending += [int(child) for child in task.read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


# Run under the vLLM venv: vLLM's benchmark client against a base URL; prints one JSON line.
VLLM_BENCH = """
import argparse, json, sys
from vllm.benchmarks.serve import add_cli_args, main
parser = argparse.ArgumentParser()
add_cli_args(parser)
r = main(parser.parse_args(sys.argv[1:]))
print(json.dumps({k: r[k] for k in ("output_throughput", "median_ttft_ms", "p99_ttft_ms",
                                     "median_tpot_ms", "completed", "total_output_tokens")}))
"""


def vllm_bench(
    python: str, base: str, name: str, model_dir: Path, concurrency: int, args: argparse.Namespace,
    seed: int,
) -> Figures:  # fmt: skip
    """One run of vLLM's benchmark client against the server at ``base``."""
    command = [python, "-P", "-c", VLLM_BENCH, "--base-url", base, "--model", name]
    command += ["--tokenizer", str(model_dir), "--dataset-name", "random", "--ignore-eos"]
    command += ["--random-input-len", str(args.random_input_len), "--random-output-len"]
    command += [str(args.random_output_len), "--num-prompts", str(args.num_prompts)]
    command += ["--max-concurrency", str(concurrency), "--seed", str(seed), "--disable-tqdm"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd="/")
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed: {done.stderr[-2000:]}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    if r["completed"] != args.num_prompts:
        raise RuntimeError(f"vllm bench serve: {r['completed']} of {args.num_prompts} completed")
    return Figures(
        r["output_throughput"],
        r["median_ttft_ms"],
        r["p99_ttft_ms"],
        r["median_tpot_ms"],
        r["total_output_tokens"],
    )


def percentile(values: list[float], q: float) -> float:
    """Over the finite values: a call whose answer had no text has no TTFT (NaN), and a NaN
    among the values would leave ``sorted`` unordered."""
    ordered = sorted(v for v in values if v == v)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def prompt(i: int, words: int) -> str:
    return f"Request {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))


async def one_call(
    client: httpx.AsyncClient, base: str, model: str, text: str, max_tokens: int
) -> tuple[float, list[float], int]:
    """(TTFT, inter-token gaps, output tokens) of one streamed chat completion."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                arrivals.append(time.perf_counter())
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return (arrivals[0] - started if arrivals else float("nan")), gaps, tokens


async def measure(
    base: str, model: str, concurrency: int, requests: int, words: int, max_tokens: int, seed: int
) -> Figures:
    texts = [prompt(seed * 1000 + i, words) for i in range(requests)]
    queue: asyncio.Queue[str] = asyncio.Queue()
    for text in texts:
        queue.put_nowait(text)
    ttfts: list[float] = []
    gaps: list[float] = []
    total = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal total
        while not queue.empty():
            ttft, itl, tokens = await one_call(client, base, model, queue.get_nowait(), max_tokens)
            ttfts.append(ttft)
            gaps.extend(itl)
            total += tokens

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return Figures(
        total / wall,
        1000 * percentile(ttfts, 0.5),
        1000 * percentile(ttfts, 0.99),
        1000 * percentile(gaps, 0.5) if gaps else float("nan"),
        total,
    )


@contextmanager
def server(
    command: list[str], env: dict[str, str], base: str, what: str, ready_s: float
) -> Iterator[int]:
    """The server up and answering; yields its pid. Its log goes to a file (a pipe nobody
    reads would block it once full)."""
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log)
        try:
            deadline = time.monotonic() + ready_s
            while True:
                if process.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"{what} exited: {log.read()[-2000:]}")
                try:
                    if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{what} did not become ready in {ready_s:g} s")
                time.sleep(0.5)
            yield process.pid
        finally:
            stop(process, timeout_s=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-python", help="python of a venv with vLLM's CPU build")
    parser.add_argument("--model", help="Hugging Face folder (default: kvgate's tiny model)")
    parser.add_argument("--dtype", help="bfloat16 | float32 (default: the CPU's native one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=24, help="calls per measurement")
    parser.add_argument("--prompt-words", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--kvgate-flags", default="", help="extra `kvgate serve` flags")
    parser.add_argument(
        "--kvgate-env", nargs="*", default=[], metavar="NAME=VALUE", help="for kvgate alone"
    )
    parser.add_argument(
        "--vllm-env", nargs="*", default=[], metavar="NAME=VALUE", help="for vLLM alone"
    )
    parser.add_argument("--vllm-bench", action="store_true", help="vLLM's own client measures")
    parser.add_argument("--only", choices=["kvgate", "vllm"], help="measure one server alone")
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--probe-ms", type=float, default=100, help="light-endpoint probe interval")
    parser.add_argument("--json", metavar="PATH", help="also write every round's figures here")
    args = parser.parse_args()
    if args.vllm_bench and not args.vllm_python:
        raise SystemExit("--vllm-bench runs vLLM's client: give --vllm-python")
    model_dir = Path(args.model) if args.model else default_model_dir()
    dtype = args.dtype or ("bfloat16" if native_bf16_flags() else "float32")
    name = "bench-model"
    levels = [int(c) for c in args.concurrency.split(",")]
    print(f"model {model_dir} as {name!r}, dtype {dtype}, load {os.getloadavg()[0]:.2f}")

    kv_port, vllm_port = free_port(), free_port()
    kv_base, vllm_base = f"http://127.0.0.1:{kv_port}", f"http://127.0.0.1:{vllm_port}"
    kvgate = [sys.executable, "-m", "kvgate", "serve", "--port", str(kv_port)]
    kvgate += ["--model", str(model_dir), "--served-model-name", name, "--max-model-len", "2048"]
    kvgate += args.kvgate_flags.split()
    kv_env = {**os.environ, "KVGATE_KV_CACHE_MEMORY": "256MiB", "KVGATE_DTYPE": dtype}
    kv_env.update(item.split("=", 1) for item in args.kvgate_env)
    servers = {"kvgate": (kvgate, kv_env, kv_base, 600.0)}  # a first start builds kernels
    if args.vllm_python:
        vllm = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model"]
        vllm += [str(model_dir), "--host", "127.0.0.1", "--port", str(vllm_port), "--dtype"]
        vllm += [dtype, "--max-model-len", "2048", "--served-model-name", name]
        vllm += ["--enable-prompt-tokens-details"]
        vllm_env = peer_environment(args.vllm_python, 2)
        vllm_env.update(item.split("=", 1) for item in args.vllm_env)
        servers["vllm"] = (vllm, vllm_env, vllm_base, 600.0)
    else:
        print("vllm: skipped (no --vllm-python)")
    if args.only:
        servers = {args.only: servers[args.only]}

    best: dict[tuple[str, int], Figures] = {}
    rounds: dict[tuple[int, int], dict[str, Figures]] = {}  # (round, c) -> server -> figures
    for round_ in range(args.rounds):
        for who, (command, env, base, ready_s) in servers.items():  # one server up at a time
            with server(command, env, base, who, ready_s) as pid:
                asyncio.run(measure(base, name, 2, 4, args.prompt_words, 8, seed=99))  # warm up
                interval_s, mcp = args.probe_ms / 1000, who == "kvgate"
                with Prober(base, mcp, interval_s) as idle:
                    time.sleep(40 * interval_s)
                idle_line = "  ".join(f"{p} {ms:.1f} ms" for p, ms in idle.p99_ms().items())
                print(f"round {round_} {who:6s} idle probes p99: {idle_line}", flush=True)
                for c in levels:
                    seed = round_ * 10 + c
                    cpu_before = cpu_seconds(pid)
                    with Prober(base, mcp, interval_s) as loaded:
                        if args.vllm_bench:
                            got = vllm_bench(args.vllm_python, base, name, model_dir, c, args, seed)
                        else:
                            got = asyncio.run(
                                measure(
                                    base, name, c, args.requests, args.prompt_words,
                                    args.max_tokens, seed=seed,
                                )
                            )  # fmt: skip
                    got.cpu_ms_per_token = 1000 * (cpu_seconds(pid) - cpu_before) / got.tokens
                    got.probes_p99_ms = loaded.p99_ms()
                    print(f"round {round_} {who:6s} c={c:<3d} {got.line()}", flush=True)
                    rounds.setdefault((round_, c), {})[who] = got
                    if (who, c) not in best or got.tokens_per_s > best[who, c].tokens_per_s:
                        best[who, c] = got
    measured = [
        {"server": who, "concurrency": c, "round": r, **asdict(figures)}
        for (r, c), pair in sorted(rounds.items())
        for who, figures in pair.items()
    ]
    record.write(args.json, "openai", measured)
    print(f"\nbest of {args.rounds} rounds (load {os.getloadavg()[0]:.2f}):")
    for (who, c), figures in sorted(best.items()):
        print(f"{who:6s} c={c:<3d} {figures.line()}")
    for (r, c), pair in sorted(rounds.items()):
        if len(pair) == 2:
            print(f"round {r} c={c}: {ratios(pair['kvgate'], pair['vllm'])}")
    for c in levels:
        if ("vllm", c) in best and ("kvgate", c) in best:
            print(f"best c={c}: {ratios(best['kvgate', c], best['vllm', c])}")


def ratios(k: Figures, v: Figures) -> str:
    """kvgate's figures over vLLM's."""
    return (
        f"throughput {k.tokens_per_s / v.tokens_per_s:.2f}x vLLM, "
        f"TTFT p50 {k.ttft_p50_ms / v.ttft_p50_ms:.2f}x, "
        f"p99 {k.ttft_p99_ms / v.ttft_p99_ms:.2f}x, ITL {k.itl_p50_ms / v.itl_p50_ms:.2f}x, "
        f"CPU per token {k.cpu_ms_per_token / v.cpu_ms_per_token:.2f}x, "
        f"/v1/models p99 {k.probes_p99_ms['/v1/models']:.1f} vs "
        f"{v.probes_p99_ms['/v1/models']:.1f} ms"
    )


if __name__ == "__main__":
    main()
