"""Fleet mode's own cost: a router in front of three upstreams that answer at once.

Three ``benchmarks.instant_upstream`` processes; in front of them, one after the other in the
same run, kvgate in fleet mode (``--routing prefix``, 1 and ``--workers`` processes; the
latter also following the upstreams' silent KV-event publishers, so the precise rule routes
every call: its cost per call, against plain kvgate's) and, when installed, the Rust routers
a fleet operator would otherwise pick: sglang-router (``python -m sglang_router.launch_router
--policy cache_aware``) and vllm-router (``vllm-router --policy cache_aware``, which asks an
upstream to render each call before it routes it). ``benchmarks.loadgen`` drives each with a
closed loop of non-streamed (and then streamed) ``/v1/chat/completions`` calls over
keep-alive connections and reports req/s, p50/p99 and the router's CPU per call, summed over
its whole process tree (every kvgate worker). Several rounds, interleaved, with ``uptime``.

    python benchmarks/fleet.py --workload overhead --rounds 3 --duration 8
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import orjson

from benchmarks import record
from benchmarks.loopback import free_port, stop

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "You are a helpful assistant. Answer the question in one word. " * 4


def request_bytes(port: int, streamed: bool, model: str = "instant") -> bytes:
    body = orjson.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 8,
            "stream": streamed,
        }
    )
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Router:
    """A router process in front of the upstreams, ready once it answers a call."""

    def __init__(
        self, name: str, command: Callable[[int], list[str]], model: str = "instant"
    ) -> None:
        self.name, self.port = name, free_port()
        self.process = subprocess.Popen(
            command(self.port),
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        body = orjson.loads(request_bytes(self.port, False, model).split(b"\r\n\r\n", 1)[1])
        deadline = time.monotonic() + 60
        while True:
            assert self.process.poll() is None, f"{name} exited"
            assert time.monotonic() < deadline, f"{name} never answered"
            try:
                url = f"http://127.0.0.1:{self.port}/v1/chat/completions"
                if httpx.post(url, json=body, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def stop(self) -> None:
        stop(self.process, 30)


def drive(router: Router, args: argparse.Namespace, streamed: bool) -> dict[str, float]:
    with tempfile.NamedTemporaryFile(suffix=".bin") as file:
        file.write(request_bytes(router.port, streamed))
        file.flush()
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.loadgen", "--port", str(router.port)]
            + ["--request-file", file.name, "--duration", str(args.duration)]
            + ["--concurrency", str(args.concurrency), "--watch-pid", str(router.process.pid)],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    if out.returncode != 0:
        raise RuntimeError(f"loadgen failed against {router.name}: {out.stderr[-2000:]}")
    return dict(json.loads(out.stdout))


Command = Callable[[int], list[str]]


def kvgate(urls: list[str], workers: int, *flags: str) -> Command:
    """kvgate in fleet mode over ``urls`` (prefix routing), listening on the port given."""
    upstreams = [f for url in urls for f in ("--upstream", url)]
    return lambda port: (
        [sys.executable, "-m", "kvgate", "serve", "--port", str(port), *upstreams]
        + ["--routing", "prefix", "--workers", str(workers), *flags]
    )


def peer_routers(urls: list[str]) -> list[tuple[str, Command]]:
    """The Rust routers a fleet operator would pick instead, when installed, with their
    ``cache_aware`` policy. Their metrics listeners default to port 29000, which another
    router may hold: a free one each."""
    out = []
    for package, log_level in (("sglang_router", "warn"), ("vllm_router", "warning")):
        name = package.replace("_", "-")
        if importlib.util.find_spec(package) is None:
            print(f"{name} is not installed: it is left out (pip install {name})")
            continue
        out.append(
            (
                f"{name} cache_aware",
                lambda port, package=package, log_level=log_level: (
                    [sys.executable, "-m", f"{package}.launch_router"]
                    + ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls]
                    + ["--policy", "cache_aware", "--log-level", log_level]
                    + ["--prometheus-port", str(free_port())]
                ),
            )
        )
    return out


def routers(urls: list[str], event_ports: list[int], workers: int) -> list[tuple[str, Command]]:
    """kvgate with 1 and ``workers`` processes, the latter also following the upstreams'
    (silent) KV-event publishers so every call is routed by the precise rule; the peers."""
    events = [
        flag
        for url, port in zip(urls, event_ports, strict=True)
        for flag in ("--upstream-kv-events", f"{url}=tcp://127.0.0.1:{port}")
    ]
    return [
        ("kvgate", kvgate(urls, 1)),
        (f"kvgate --workers {workers}", kvgate(urls, workers)),
        (f"kvgate --workers {workers} precise", kvgate(urls, workers, *events)),
        *peer_routers(urls),
    ]


def run(args: argparse.Namespace) -> None:
    ports = [free_port() for _ in range(3)]
    event_ports = [free_port() for _ in range(3)]
    upstreams = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.instant_upstream", "--port", str(p)]
            + ["--kv-events-port", str(e)],
            cwd=ROOT,
        )
        for p, e in zip(ports, event_ports, strict=True)
    ]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    rows: list[tuple[str, str, int, dict[str, float], str]] = []
    try:
        time.sleep(1)
        for round_ in range(args.rounds):
            for name, command in routers(urls, event_ports, args.workers):
                router = Router(name, command)
                try:
                    for streamed in (False, True):
                        load = os.getloadavg()[0]
                        figures = drive(router, args, streamed)
                        kind = "streamed" if streamed else "non-streamed"
                        rows.append((name, kind, round_, figures, f"{load:.1f}"))
                finally:
                    router.stop()
    finally:
        for u in upstreams:
            u.terminate()
            u.wait()
    measured = [
        {"router": name, "call": kind, "round": round_, "load": float(load), **figures}
        for name, kind, round_, figures, load in rows
    ]
    record.write(args.json, "router", measured)
    print(
        f"\nthree instant upstreams, closed loop c={args.concurrency} /v1/chat/completions, "
        f"{args.duration:g} s per run, {args.rounds} rounds, {os.cpu_count()} CPUs\n"
    )
    print(
        "| router | call | round | req/s | p50 ms | p99 ms | CPU ms per call (all its processes) | load |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, kind, round_, f, load in rows:
        print(
            f"| {name} | {kind} | {round_} | {f['rps']:.0f} | {f['p50_ms']:.1f} | "
            f"{f['p99_ms']:.1f} | {f['server_us_per_request'] / 1e3:.3f} | {load} |"
        )
    ours = [r for r in rows if r[0] == f"kvgate --workers {args.workers}"]
    precise = [r for r in rows if r[0] == f"kvgate --workers {args.workers} precise"]
    for kind in ("non-streamed", "streamed"):
        plain = [r[3]["server_us_per_request"] for r in ours if r[1] == kind]
        followed = [r[3]["server_us_per_request"] for r in precise if r[1] == kind]
        print(
            f"{kind}: precise routing's CPU per call / plain kvgate's = "
            f"{sum(followed) / sum(plain):.2f}x (kvgate --workers {args.workers}, same rounds)"
        )
    for peer in ("sglang-router", "vllm-router"):
        theirs_rows = [r for r in rows if r[0].startswith(peer)]
        for kind in ("non-streamed", "streamed"):
            mine = [r[3] for r in ours if r[1] == kind]
            theirs = [r[3] for r in theirs_rows if r[1] == kind]
            if mine and theirs:
                ratio = sum(m["rps"] for m in mine) / sum(t["rps"] for t in theirs)
                cpu = sum(m["server_us_per_request"] for m in mine) / len(mine) / 1e3
                print(
                    f"{kind}: kvgate --workers {args.workers} req/s / {peer}'s = "
                    f"{ratio:.2f}x, kvgate CPU per call {cpu:.3f} ms"
                )
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
