"""A server under hostile input: its RSS and /healthz latency while a 64 MiB header line and
three ~1 MiB bodies arrive (issue 16); then /healthz and another tenant's stream while three
~1 MiB bodies of 128 tools' JSON Schemas and two 70k-entry ``choice`` grammars arrive, and
the compiled-grammar cache's resident bytes against its limit (issue 27); then a fleet
gateway's RSS and /healthz while its own upstream attacks it, and while calls make it read
24 MiB records back from Redis (issue 44). Loopback only; every loop is bounded.

    python -m benchmarks.hostile [--header-mib 64] [--body-kib 1000] [--probe-ms 10]
                                 [--tools generate,chat,tokenize]   ("" for the header alone)
                                 [--tool-bodies 3] [--choices 70000] [--choice-bodies 2]
                                 [--cases bodies,tools,upstream,records]
                                 [--upstream-attacks endless-header,endless-comments,...]
                                 [--attack-s 3] [--record-mib 24]
                                 [--kvgate-flags "--model DIR"]

Starts ``python -m kvgate serve`` (the embedded tiny model) on a free port, measures its RSS
(``/proc/PID/status`` VmRSS, sampled every 10 ms) and ``/healthz`` round trips on a kept-alive
connection before and during the attack, and prints one JSON line of figures. The bodies are
a ``generate`` prompt, a ``chat`` message and a ``tokenize`` text of ``--body-kib`` each (just
under the default 1 MiB body limit), sent concurrently; the header line goes on its own
connection in 64 KiB writes until the server hangs up. The attackers run in processes of
their own so their work does not slow the probe. p99 is over the probes of the attack window
(from its start until every attacker is answered), so one long pause dominates it.
``rss_kept_mib`` is what the server still holds 1 s after the last answer; each body's
answer says whether it was served or refused (a tool error, and the start of its text).

The ``tools`` case runs with two API-key tenants: the attacker sends the tool bodies (OpenAI
chats, each tool's ``parameters`` a distinct ~8 KB schema of nested objects: nothing is
cached) and the choice lists (``/v1/completions`` with vLLM's ``structured_outputs:
{"choice": [...]}``, distinct lists); the victim tenant streams a completion throughout
(restarted if it ends), and ``stream_max_gap_ms`` is the longest wait between two of its
chunks inside the attack window. Targets: /healthz p99 < 100 ms, no gap > 100 ms.
``grammar_cache`` is read from the engine (``/metrics`` ``kvgate_grammar_cache_bytes`` and
``kvgate_grammar_cache_limit_bytes``); where the server does not expose them, the server's
RSS growth stands in (``source: "rss"``).

The ``upstream`` case runs ``kvgate serve --upstream`` in front of
``tests.gateway.upstream.raw_upstream``, an upstream that writes its answers byte for byte.
Each attack is a completion prompt that names what the upstream answers (a header line that
never ends, endless two-byte SSE comments, one SSE line that never ends, …; two callers, one
streamed and one not, back to back for ``--attack-s``), or ``pages``: no caller at all, the
gateway's own health checks and scrapes (every 0.25 s) meeting an endless header line on
``/health`` and a ``/metrics`` page just under the scrape's limit. ``rss_growth_mib`` is the
peak over the RSS before the attack. Targets: growth <= 16 MiB, /healthz p99 < 50 ms.

The ``records`` case starts a private ``redis-server`` and ``kvgate serve --redis-url`` with
two API-key tenants, leaves ``--record-mib`` records where the gateway reads back
(``benchmarks.hostile_records``: a stored response of the attacker's, valid JSON of ~800k
messages; a task; a response key holding a hash), and for ``--attack-s`` has the attacker
continue, render and ``tasks/get`` them, one caller per kind in a process of its own. Each
must read as unknown (404, or −32602 "not found"); same figures and targets as ``upstream``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor, wait
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson

from benchmarks.hostile_records import plant, record_calls
from benchmarks.hostile_tools import (
    KEYS,
    choice_body,
    grammar_cache,
    keys_file,
    openai_post,
    tool_body,
    victim_stream,
)
from benchmarks.loopback import free_port
from tests.gateway.redis_fixtures import RedisServer
from tests.gateway.upstream.evil_upstream import MODEL

CHUNK = 64 * 1024
TARGET_MS = 100


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def wait_healthy(base: str, server: subprocess.Popen[bytes], within_s: float = 120) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError("the server exited")
        try:
            health = httpx.get(base + "/healthz", timeout=1)
            if health.status_code == 200 and "loading" not in health.text:  # loaded, not loading
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the server did not come up")


def endless_header_line(port: int, total: int) -> dict[str, Any]:
    """Send one header line of ``total`` bytes; how much got out and what came back."""
    sent, reply = 0, b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Endless: ")
        block = b"a" * CHUNK
        try:
            while sent < total:
                sock.sendall(block)
                sent += CHUNK
        except OSError:
            pass
        try:
            while chunk := sock.recv(CHUNK):
                reply += chunk
        except OSError:
            pass
    return {"header_bytes_sent": sent, "header_reply": reply.split(b"\r\n", 1)[0].decode()}


def big_call(base: str, tool: str, size: int) -> str:
    """One ~``size``-byte tools/call; ``tool:status:ok`` or ``tool:status:error`` (a tool
    error: refused, as a prompt that cannot fit is) and the start of the error's text."""
    text = "word " * (size // 5)
    many = [{"role": "user", "content": "hi"}] * (size // 31)  # 31 bytes of JSON each
    arguments: dict[str, Any] = {
        "generate": {"prompt": text, "max_tokens": 1},
        "chat": {"messages": [{"role": "user", "content": text}], "max_tokens": 1},
        "chat-many": {"messages": many, "max_tokens": 1},
        "tokenize": {"text": text},
    }[tool]
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": tool.split("-")[0], "arguments": arguments},
    }
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    response = httpx.post(base + "/mcp", content=orjson.dumps(body), headers=headers, timeout=120)
    outcome = ""
    if response.status_code == 200:
        result = response.json().get("result") or {}
        outcome = ":error " + result["content"][0]["text"][:80] if result.get("isError") else ":ok"
    return f"{tool}:{response.status_code}{outcome}"


def probe(base: str, stop: threading.Event, every_s: float, out: list[float]) -> None:
    with httpx.Client(base_url=base, timeout=30) as http:
        while not stop.is_set() and len(out) < 100_000:
            began = time.perf_counter()
            http.get("/healthz").raise_for_status()
            out.append(time.perf_counter() - began)
            time.sleep(every_s)


def sample_rss(pid: int, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set() and len(out) < 100_000:
        out.append(rss_mib(pid))
        time.sleep(0.01)


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else 0


def measure(
    base: str,
    pid: int,
    every_s: float,
    attack: list[threading.Thread],
    futures: list[Future[Any]] | None = None,
) -> dict[str, Any]:
    stop = threading.Event()
    latencies: list[float] = []
    rss: list[float] = []
    watchers = [
        threading.Thread(target=probe, args=(base, stop, every_s, latencies)),
        threading.Thread(target=sample_rss, args=(pid, stop, rss)),
    ]
    for thread in watchers:
        thread.start()
    time.sleep(0.5)
    for thread in attack:
        thread.start()
    for thread in attack:
        thread.join(timeout=300)
    wait(futures or [], timeout=300)
    stop.set()
    for thread in watchers:
        thread.join(timeout=30)
    return {
        "healthz_p50_ms": round(1000 * percentile(latencies, 50), 2),
        "healthz_p99_ms": round(1000 * percentile(latencies, 99), 2),
        "healthz_max_ms": round(1000 * max(latencies), 2),
        "healthz_probes": len(latencies),
        "rss_peak_mib": round(max(rss), 1),
    }


def tools_case(base: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    """/healthz and the victim's stream while tool bodies and choice lists arrive."""
    size = args.body_kib * 1024
    stop = threading.Event()
    gaps: list[tuple[float, float]] = []
    streamer = threading.Thread(target=victim_stream, args=(base, stop, gaps))
    streamer.start()
    time.sleep(1.0)  # the stream is flowing before the attack
    baseline = rss_mib(pid)
    bodies = [tool_body(i, 128, size) for i in range(args.tool_bodies)]
    grammars = [choice_body(i, args.choices) for i in range(args.choice_bodies)]
    key = KEYS["attacker"]
    window: list[float] = []
    attackers = len(bodies) + len(grammars)  # one process each: all at once
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max(1, attackers), mp_context=spawn) as pool:
        pool.submit(time.sleep, 0).result()
        futures: list[Future[Any]] = []

        def launch(path: str, content: bytes) -> threading.Thread:
            return threading.Thread(
                target=lambda: futures.append(pool.submit(openai_post, base, path, content, key))
            )

        attack = [launch("/v1/chat/completions", body) for body in bodies]
        attack += [launch("/v1/completions", body) for body in grammars]
        attack.insert(0, threading.Thread(target=lambda: window.append(time.perf_counter())))
        hostile = measure(base, pid, args.probe_ms / 1000, attack, futures)
        window.append(time.perf_counter())
        answers = sorted(future.result() for future in futures)
    stop.set()
    streamer.join(timeout=60)
    inside = [gap for at, gap in gaps if window[0] <= at <= window[-1]]
    cache = grammar_cache(base)
    if cache is None:
        cache = {"source": "rss", "rss_growth_mib": round(rss_mib(pid) - baseline, 1)}
    stream_max = round(1000 * max(inside, default=0), 1)
    return {
        "attack_s": round(window[-1] - window[0], 2),
        "hostile": hostile,
        "stream_chunks": len(inside),
        "stream_gap_p99_ms": round(1000 * percentile(inside, 99), 1),
        "stream_max_gap_ms": stream_max,
        "answers": answers,
        "grammar_cache": cache,
        "targets_met": {
            "healthz_p99_lt_100ms": hostile["healthz_p99_ms"] < TARGET_MS,
            "stream_gap_lt_100ms": bool(inside) and stream_max < TARGET_MS,
            "grammar_cache_within_limit": cache.get("bytes", 0) <= cache.get("limit_bytes", -1),
        },
    }


@contextmanager
def serving(
    *flags: str, command: tuple[str, ...] = ("kvgate", "serve")
) -> Iterator[tuple[str, int]]:
    """``kvgate serve`` (or another server module taking ``--port``) on a free port: its base
    URL and pid, stopped afterwards."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", *command, "--port", str(port), *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(base, server)
        time.sleep(1.0)
        yield base, server.pid
    finally:
        server.terminate()
        server.wait(timeout=30)


def bodies_case(base: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    """RSS and /healthz under the 64 MiB header line and the three ~1 MiB MCP bodies."""
    port = int(base.rsplit(":", 1)[1])
    calm = measure(base, pid, args.probe_ms / 1000, [])
    baseline = rss_mib(pid)
    # The attackers run in processes of their own: their work must not slow the probe.
    with ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("spawn")) as pool:
        pool.submit(time.sleep, 0).result()  # started before the clock runs
        futures: list[Future[Any]] = []

        def launch(work: Any, *work_args: Any) -> threading.Thread:
            return threading.Thread(target=lambda: futures.append(pool.submit(work, *work_args)))

        attack = [launch(endless_header_line, port, args.header_mib << 20)]
        tools = [tool for tool in args.tools.split(",") if tool]
        attack += [launch(big_call, base, tool, args.body_kib * 1024) for tool in tools]
        hostile = measure(base, pid, args.probe_ms / 1000, attack, futures)
        outcomes = [future.result() for future in futures]
    time.sleep(1.0)
    after = rss_mib(pid)  # what stays once every attacker is answered
    results = next(o for o in outcomes if isinstance(o, dict))
    answers = [o for o in outcomes if isinstance(o, str)]
    return {
        "rss_baseline_mib": round(baseline, 1),
        # the peak of the window or after it: the 10 ms samples can miss a short peak
        "rss_growth_mib": round(max(hostile["rss_peak_mib"], after) - baseline, 1),
        "rss_kept_mib": round(after - baseline, 1),
        "calm": calm,
        "hostile": hostile,
        **results,
        "bodies": sorted(answers),
    }


RAW_UPSTREAM = ("tests.gateway.upstream.raw_upstream",)
# A breaker that never opens (an attack that took the upstream out would stop reaching the
# gateway) and a read timeout that bounds a call the attack holds silent.
UPSTREAM_FLAGS = ("--upstream-unhealthy-after", "1000000", "--upstream-read-timeout", "3")
PAGE_FLAGS = ("--upstream-health-interval", "0.25", "--upstream-scrape-interval", "0.25")
UPSTREAM_TARGETS = {"rss_growth_mib": 16, "healthz_p99_ms": 50}


def attack_calls(base: str, prompt: str, seconds: float, streamed: bool) -> dict[str, int]:
    """Completions naming ``prompt`` back to back for ``seconds``: how many ended how (the
    status, ``error`` for a stream that carried an error event, or ``timeout``: no answer
    within 30 s)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "stream": streamed}
    outcomes: dict[str, int] = {}
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=base, timeout=30) as http:
        while time.monotonic() < deadline and sum(outcomes.values()) < 100_000:
            try:
                response = http.post("/v1/completions", json=body)
            except httpx.TimeoutException:
                outcome = "timeout"
            else:
                error = response.status_code == 200 and b'"error"' in response.content
                outcome = f"{response.status_code}{' error' if error else ''}"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes


def upstream_attack(
    base: str,
    pid: int,
    args: argparse.Namespace,
    prompt: str | None,
    pool: ProcessPoolExecutor,
) -> dict[str, Any]:
    """RSS and /healthz while two callers (one streamed) name ``prompt`` for ``--attack-s``
    in ``pool``'s processes, or, with no prompt, while the gateway's own checks and scrapes
    run that long."""
    good = {"model": MODEL, "prompt": "good", "max_tokens": 5}
    httpx.post(base + "/v1/completions", json=good, timeout=30).raise_for_status()
    baseline = rss_mib(pid)
    futures: list[Future[Any]] = []

    def launch(streamed: bool) -> threading.Thread:
        def run() -> None:
            futures.append(pool.submit(attack_calls, base, prompt, args.attack_s, streamed))

        return threading.Thread(target=run)

    if prompt is None:
        attack = [threading.Thread(target=time.sleep, args=(args.attack_s,))]
    else:
        attack = [launch(False), launch(True)]
    hostile = measure(base, pid, args.probe_ms / 1000, attack, futures)
    calls: dict[str, int] = {}
    for future in futures:
        for outcome, count in future.result().items():
            calls[outcome] = calls.get(outcome, 0) + count
    return against_targets(baseline, hostile, calls)


def against_targets(baseline: float, hostile: dict[str, Any], calls: Any) -> dict[str, Any]:
    """A case's figures: the process's growth over its baseline and /healthz's p99 under the
    attack, each against its target (``UPSTREAM_TARGETS``)."""
    growth = round(hostile["rss_peak_mib"] - baseline, 1)
    return {
        "rss_baseline_mib": round(baseline, 1),
        "rss_growth_mib": growth,
        "hostile": hostile,
        "calls": calls,
        "targets_met": {
            "rss_growth_le_16mib": growth <= UPSTREAM_TARGETS["rss_growth_mib"],
            "healthz_p99_lt_50ms": hostile["healthz_p99_ms"] < UPSTREAM_TARGETS["healthz_p99_ms"],
        },
    }


def upstream_case(args: argparse.Namespace) -> dict[str, Any]:
    """Each of ``--upstream-attacks`` against a fleet gateway in front of the raw upstream:
    the completion attacks one after the other on one pair, ``pages`` on a pair of its own.
    The callers run in processes of their own (started before the clock runs), so their work
    does not slow the probe."""
    attacks = [attack for attack in args.upstream_attacks.split(",") if attack]
    figures: dict[str, Any] = {}
    prompts = [attack for attack in attacks if attack != "pages"]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(time.sleep, [0.2, 0.2]))
        if prompts:
            with (
                serving(command=RAW_UPSTREAM) as (upstream, _),
                serving("--upstream", upstream, *UPSTREAM_FLAGS) as (base, pid),
            ):
                for prompt in prompts:
                    figures[prompt] = upstream_attack(base, pid, args, prompt, pool)
        if "pages" in attacks:
            pages = ("--health", "endless-header", "--metrics", "huge")
            with (
                serving(*pages, command=RAW_UPSTREAM) as (upstream, _),
                serving("--upstream", upstream, *UPSTREAM_FLAGS, *PAGE_FLAGS) as (base, pid),
            ):
                figures["pages"] = upstream_attack(base, pid, args, None, pool)
    return figures


def records_case(args: argparse.Namespace) -> dict[str, Any]:
    """RSS and /healthz while the attacker's calls name the planted records (see the module)."""
    spawn = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as folder, RedisServer(Path(folder)) as redis_server:
        ids = plant(redis_server.url, args.record_mib)
        kinds = {"response": ids["response"], "render": ids["response"]}
        kinds |= {"hash": ids["hash"], "task": ids["task"]}
        flags = ("--model", "tiny", "--redis-url", redis_server.url)
        flags += ("--api-keys-file", keys_file(folder))
        with (
            serving(*flags) as (base, pid),
            ProcessPoolExecutor(len(kinds), mp_context=spawn) as pool,
        ):
            list(pool.map(time.sleep, [0.2] * len(kinds)))  # started before the clock runs
            baseline = rss_mib(pid)
            futures: list[Future[Any]] = []  # filled by the attack's threads, as measure waits
            submitted: dict[str, Future[Any]] = {}

            def launch(kind: str) -> threading.Thread:
                def run() -> None:
                    future = pool.submit(record_calls, base, kind, kinds[kind], args.attack_s)
                    submitted[kind] = future
                    futures.append(future)

                return threading.Thread(target=run)

            attack = [launch(kind) for kind in kinds]
            hostile = measure(base, pid, args.probe_ms / 1000, attack, futures)
            calls = {kind: future.result() for kind, future in submitted.items()}
    return {"record_mib": args.record_mib, **against_targets(baseline, hostile, calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--header-mib", type=int, default=64)
    parser.add_argument("--body-kib", type=int, default=1000)
    parser.add_argument("--probe-ms", type=float, default=10)
    parser.add_argument("--kvgate-flags", default="", help="extra `kvgate serve` flags")
    parser.add_argument(
        "--tools",
        default="generate,chat,tokenize",
        help="one body per tool (chat-many: a chat of ~1 MiB of short messages)",
    )
    parser.add_argument("--tool-bodies", type=int, default=3, help="chats of 128 tools")
    parser.add_argument("--choices", type=int, default=70_000, help="entries per choice list")
    parser.add_argument("--choice-bodies", type=int, default=2, help="distinct choice lists")
    parser.add_argument("--cases", default="bodies,tools,upstream,records", help="a list of cases")
    parser.add_argument(
        "--upstream-attacks",
        default="endless-header,endless-headers,endless-trailer,endless-comments,endless-line,pages",
        help="raw_upstream answers (completion prompts) and pages (its /health and /metrics)",
    )
    parser.add_argument("--attack-s", type=float, default=3.0, help="seconds per attack")
    parser.add_argument("--record-mib", type=int, default=24, help="each record's size")
    args = parser.parse_args()
    cases = set(args.cases.split(","))
    flags = ["--model", "tiny", *args.kvgate_flags.split()]
    figures: dict[str, Any] = {}
    if "bodies" in cases:
        with serving(*flags) as (base, pid):
            figures.update(bodies_case(base, pid, args))
    if "tools" in cases:
        with (
            tempfile.TemporaryDirectory() as folder,
            serving(*flags, "--api-keys-file", keys_file(folder)) as (base, pid),
        ):
            figures["tools_and_grammars"] = tools_case(base, pid, args)
    if "upstream" in cases:
        figures["upstream"] = upstream_case(args)
    if "records" in cases:
        figures["records"] = records_case(args)
    figures["load_average"] = os.getloadavg()
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
