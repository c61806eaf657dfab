"""A server under hostile input: its RSS and /healthz latency while a 64 MiB header line and
three ~1 MiB bodies arrive (issue 16). Loopback only; every loop is bounded.

    python -m benchmarks.hostile [--header-mib 64] [--body-kib 1000] [--probe-ms 10]
                                 [--tools generate,chat,tokenize]   ("" for the header alone)
                                 [--kvgate-flags "--model DIR"]

Starts ``python -m gateway serve`` (the embedded tiny model) on a free port, measures its RSS
(``/proc/PID/status`` VmRSS, sampled every 10 ms) and ``/healthz`` round trips on a kept-alive
connection before and during the attack, and prints one JSON line of figures. The bodies are
a ``generate`` prompt, a ``chat`` message and a ``tokenize`` text of ``--body-kib`` each (just
under the default 1 MiB body limit), sent concurrently; the header line goes on its own
connection in 64 KiB writes until the server hangs up. The attackers run in processes of
their own so their work does not slow the probe. p99 is over the probes of the attack window
(from its start until every attacker is answered), so one long pause dominates it.
``rss_kept_mib`` is what the server still holds 1 s after the last answer; each body's
answer says whether it was served or refused (a tool error, and the start of its text).
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
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor, wait
from typing import Any

import httpx
import orjson

from benchmarks.loopback import free_port

CHUNK = 64 * 1024


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
            if httpx.get(base + "/healthz", timeout=1).status_code == 200:
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
    args = parser.parse_args()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", str(port), *args.kvgate_flags.split()],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_healthy(base, server)
        time.sleep(1.0)
        calm = measure(base, server.pid, args.probe_ms / 1000, [])
        baseline = rss_mib(server.pid)
        # The attackers run in processes of their own: their work must not slow the probe.
        with ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("spawn")) as pool:
            pool.submit(time.sleep, 0).result()  # started before the clock runs
            futures: list[Future[Any]] = []

            def launch(work: Any, *work_args: Any) -> threading.Thread:
                return threading.Thread(
                    target=lambda: futures.append(pool.submit(work, *work_args))
                )

            attack = [launch(endless_header_line, port, args.header_mib << 20)]
            tools = [tool for tool in args.tools.split(",") if tool]
            attack += [launch(big_call, base, tool, args.body_kib * 1024) for tool in tools]
            hostile = measure(base, server.pid, args.probe_ms / 1000, attack, futures)
            outcomes = [future.result() for future in futures]
        time.sleep(1.0)
        after = rss_mib(server.pid)  # what stays once every attacker is answered
        results = next(o for o in outcomes if isinstance(o, dict))
        answers = [o for o in outcomes if isinstance(o, str)]
        figures = {
            "rss_baseline_mib": round(baseline, 1),
            # the peak of the window or after it: the 10 ms samples can miss a short peak
            "rss_growth_mib": round(max(hostile["rss_peak_mib"], after) - baseline, 1),
            "rss_kept_mib": round(after - baseline, 1),
            "calm": calm,
            "hostile": hostile,
            **results,
            "bodies": sorted(answers),
            "load_average": os.getloadavg(),
        }
        print(json.dumps(figures))
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
