"""Envoy + ``kvgate epp`` against kvgate's fleet proxy and sglang-router: what deciding
without relaying costs.

Three ``benchmarks.instant_upstream`` processes; in front of them, one after the other in the
same run: a real Envoy (``examples/deploy/envoy/envoy.yaml``, ports moved, in the full-duplex
body mode the Gateway API Inference Extension uses, then buffered) asking ``kvgate epp`` for
each request's upstream; kvgate in fleet mode (``--workers N``), which relays every byte in
Python; and sglang-router ``cache_aware`` when installed. ``benchmarks.loadgen`` drives each
with a closed loop of c=32 non-streamed ``/v1/chat/completions`` calls over keep-alive
connections: req/s, p50/p99, and the CPU per call of the whole path (Envoy's and the picker's
processes together, as one tree), split between Envoy and kvgate by their own /proc figures.

    python -m benchmarks.epp --rounds 2 --duration 6
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import fleet_overhead, record
from benchmarks.fleet_overhead import Command, Router
from benchmarks.loadgen import cpu_and_wait, tree
from benchmarks.loopback import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples/deploy/envoy/envoy.yaml"


def envoy_config(port: int, epp_port: int, mode: str, folder: Path) -> Path:
    text = EXAMPLE.read_text()
    for old, new in (("9002", epp_port), ("8081", port), ("9901", free_port())):
        text = text.replace(f"port_value: {old} ", f"port_value: {new} ")
    if mode != "FULL_DUPLEX_STREAMED":
        text = text.replace("request_body_mode: FULL_DUPLEX_STREAMED", f"request_body_mode: {mode}")
        text = text.replace("request_trailer_mode: SEND", "request_trailer_mode: SKIP")
    path = folder / f"envoy-{port}.yaml"
    path.write_text(text)
    return path


def envoy_with_picker(urls: list[str], mode: str, folder: Path) -> Command:
    """Envoy exec'd by a shell that first started ``kvgate epp`` in the background: one
    process tree (Envoy, the picker its child), so the load generator's CPU figure is the
    whole path's."""
    envoy = shutil.which("envoy")
    assert envoy is not None
    upstreams = " ".join(f"--upstream {url}" for url in urls)

    def command(port: int) -> list[str]:
        epp_port = free_port()
        config = envoy_config(port, epp_port, mode, folder)
        return [
            "sh",
            "-c",
            f"{sys.executable} -m kvgate epp --port {epp_port} {upstreams} 2>/dev/null & "
            f"exec {envoy} -c {config} --disable-hot-restart -l error --concurrency 2",
        ]

    return command


class PathTree(Router):
    """A router whose process has children of its own (Envoy's picker): stopped by PID."""

    def stop(self) -> None:
        children = [pid for pid in tree(self.process.pid) if pid != self.process.pid]
        super().stop()
        for pid in children:
            try:
                os.kill(pid, 15)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 10
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.05)


def measure(router: Router, args: argparse.Namespace) -> dict[str, float]:
    """loadgen's figures, plus each process's share of the tree's CPU over the same run."""
    pids = tree(router.process.pid)
    before = {pid: cpu_and_wait(pid)[0] for pid in pids}
    figures = fleet_overhead.drive(router, args, streamed=False)
    spent = {pid: cpu_and_wait(pid)[0] - before[pid] for pid in pids}
    total = sum(spent.values()) or 1.0
    per_call = figures["server_us_per_request"]
    figures["root_us_per_request"] = per_call * spent[router.process.pid] / total
    figures["children_us_per_request"] = per_call - figures["root_us_per_request"]
    return figures


def run(args: argparse.Namespace) -> None:
    ports = [free_port() for _ in range(3)]
    upstreams = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.instant_upstream", "--port", str(p)], cwd=ROOT
        )
        for p in ports
    ]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    rows: list[dict[str, Any]] = []
    try:
        time.sleep(1)
        with tempfile.TemporaryDirectory() as folder:
            contenders: list[tuple[str, Command, type[Router]]] = [
                (
                    "Envoy + kvgate epp (full duplex)",
                    envoy_with_picker(urls, "FULL_DUPLEX_STREAMED", Path(folder)),
                    PathTree,
                ),
                (
                    "Envoy + kvgate epp (buffered)",
                    envoy_with_picker(urls, "BUFFERED", Path(folder)),
                    PathTree,
                ),
                (
                    f"kvgate fleet --workers {args.workers}",
                    fleet_overhead.kvgate(urls, args.workers),
                    Router,
                ),
                *[
                    (name, command, Router)
                    for name, command in fleet_overhead.peer_routers(urls)
                    if name.startswith("sglang")
                ],
            ]
            for round_ in range(args.rounds):
                for name, command, kind in contenders:
                    router = kind(name, command)
                    try:
                        load = os.getloadavg()[0]
                        figures = measure(router, args)
                    finally:
                        router.stop()
                    rows.append(
                        {"router": name, "round": round_, "load": round(load, 2), **figures}
                    )
    finally:
        for upstream in upstreams:
            upstream.terminate()
            upstream.wait()
    record.write(args.json, "epp", rows)
    report(rows, args)


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(
        f"\n{time.strftime('%Y-%m-%d')}, {record.cpu_model()}, {os.cpu_count()} CPUs; three instant "
        f"upstreams, closed loop c={args.concurrency} non-streamed /v1/chat/completions, "
        f"{args.duration:g} s per run, {args.rounds} rounds\n"
    )
    print(
        "| path | round | req/s | p50 ms | p99 ms | CPU ms per call, whole path | of it Envoy | of it kvgate | load |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        whole = float(r["server_us_per_request"]) / 1e3
        envoy, kvgate = "", ""
        if str(r["router"]).startswith("Envoy"):
            envoy = f"{float(r['root_us_per_request']) / 1e3:.3f}"
            kvgate = f"{float(r['children_us_per_request']) / 1e3:.3f}"
        print(
            f"| {r['router']} | {r['round']} | {float(r['rps']):.0f} | {float(r['p50_ms']):.1f} | "
            f"{float(r['p99_ms']):.1f} | {whole:.3f} | {envoy} | {kvgate} | {r['load']} |"
        )

    def mean(name: str, field: str) -> float | None:
        found = [float(r[field]) for r in rows if str(r["router"]).startswith(name)]
        return sum(found) / len(found) if found else None

    theirs = mean("sglang-router", "rps")
    for name in ("Envoy + kvgate epp (full duplex)", "Envoy + kvgate epp (buffered)"):
        ours, own_cpu = mean(name, "rps"), mean(name, "children_us_per_request")
        assert ours is not None and own_cpu is not None
        against = f", {ours / theirs:.2f}x sglang-router's req/s" if theirs else ""
        print(f"{name}: {ours:.0f} req/s{against}; kvgate epp CPU per call {own_cpu / 1e3:.3f} ms")
    fleet = mean("kvgate fleet", "rps")
    if fleet and theirs:
        print(f"kvgate fleet --workers {args.workers}: {fleet / theirs:.2f}x sglang-router's req/s")
    print("uptime:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", help="write the figures here too")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
