"""MCP endpoint speed: kvgate against the official SDK's stateless server and a bare route.

One run, one machine, one uvicorn install (one worker, uvloop, httptools): `kvgate serve`
(embedded default model), the `mcp` SDK's `MCPServer` with one `echo` tool (stateless, JSON
responses) and a bare Starlette route returning kvgate's own response bytes (the ceiling).
All three stay up; one at a time is driven on `server/discover` and `tools/list` with
2026-07-28 requests (headers and `_meta`) by `loadgen.py` in its own process, in interleaved
rounds. Prints requests/s, p50, p99, the kvgate/SDK ratios against the targets (>= 2.5x
requests/s, p99 <= half), and the CPU share of client and server.

    python benchmarks/mcp.py [--duration 5] [--rounds 3] [--targets kvgate,sdk,bare]
                             [--workers N]

``--workers`` runs kvgate with that many API processes over its one engine (the SDK and the
bare route stay one uvicorn worker: the SDK's stateless server has no shared state to split).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

# Helpers run as `-m benchmarks.<name>` from the repository root. Run as a script, this file's
# folder would lead sys.path (and `import mcp` would find this module, not the SDK): the root
# takes its place.
ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)

from benchmarks.loopback import free_port, stop  # noqa: E402

VERSION = "2026-07-28"
METHODS = ("server/discover", "tools/list")
TARGETS = ("kvgate", "sdk", "bare")
RPS_TARGET, P99_TARGET = 2.5, 0.5
BUSY_WAIT = 0.10  # share of the time runnable but off the CPU above which a row is flagged


@dataclass(frozen=True)
class Server:
    """A started target: where it listens, its process id, the size of each answer."""

    port: int
    pid: int
    body_bytes: dict[str, int]


def request_parts(method: str) -> tuple[dict[str, str], bytes]:
    """Headers and body of a modern (2026-07-28) request for `method`, without Host."""
    meta = {
        "io.modelcontextprotocol/protocolVersion": VERSION,
        "io.modelcontextprotocol/clientInfo": {"name": "kvgate-bench", "version": "1.0"},
        "io.modelcontextprotocol/clientCapabilities": {},
    }
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": {"_meta": meta}}
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": VERSION,
        "Mcp-Method": method,
    }
    return headers, json.dumps(body, separators=(",", ":")).encode()


def raw_request(port: int, method: str) -> bytes:
    headers, body = request_parts(method)
    lines = ["POST /mcp HTTP/1.1", f"Host: 127.0.0.1:{port}", f"Content-Length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def fetch(port: int, method: str) -> bytes | None:
    """One request; the response body if it is a successful JSON-RPC result, else None."""
    headers, body = request_parts(method)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("POST", "/mcp", body, headers)
        response = connection.getresponse()
        payload = response.read()
    except OSError:
        return None
    finally:
        connection.close()
    if response.status != 200 or not response.getheader("content-type", "").startswith(
        "application/json"
    ):
        raise RuntimeError(f"{method}: HTTP {response.status} {payload[:300]!r}")
    result = json.loads(payload).get("result")
    if not result or (method == "tools/list" and not result.get("tools")):
        raise RuntimeError(f"{method}: not a usable result: {payload[:300]!r}")
    return payload


@contextmanager
def serving(command: list[str], port: int, startup_s: float) -> Iterator[subprocess.Popen[bytes]]:
    """Run a server until it answers `server/discover`; stop it afterwards."""
    log = tempfile.TemporaryFile()
    server = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + startup_s
        while fetch(port, METHODS[0]) is None:
            if server.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"{command} did not come up:\n{log.read().decode()[-2000:]}")
            time.sleep(0.2)
        yield server
    finally:
        stop(server, timeout_s=10)
        log.close()


def server_command(target: str, port: int, bodies_file: str, args: argparse.Namespace) -> list[str]:
    if target == "kvgate":
        command = [sys.executable, "-m", "kvgate", "serve", "--port", str(port), "--model", "tiny"]
        return command + ["--workers", str(args.workers)]
    command = [sys.executable, "-m", "benchmarks.baselines", target, "--port", str(port)]
    if target == "bare":
        command += ["--bodies", bodies_file]
    return command + (["--gc-freeze"] if args.gc_freeze else [])


def load(port: int, method: str, server_pid: int, args: argparse.Namespace) -> dict[str, float]:
    """Drive one method with loadgen.py (which also watches the server's CPU); its figures."""
    with tempfile.NamedTemporaryFile(suffix=".http") as request_file:
        request_file.write(raw_request(port, method))
        request_file.flush()
        command = [sys.executable, "-m", "benchmarks.loadgen", "--port", str(port)]
        command += ["--request-file", request_file.name, "--concurrency", str(args.concurrency)]
        command += ["--duration", str(args.duration), "--warmup", str(args.warmup)]
        command += ["--watch-pid", str(server_pid)]
        done = subprocess.run(command, cwd=ROOT, check=True, capture_output=True)
    return json.loads(done.stdout)


def start(targets: list[str], args: argparse.Namespace, stack: ExitStack) -> dict[str, Server]:
    """Start every target (left running, idle, until the stack closes) and check its answers.

    The first target's answers are what the bare route (started last) replays.
    """
    bodies: dict[str, str] = {}
    servers = {}
    for target in targets:
        print(f"starting {target} ...", file=sys.stderr, flush=True)
        port = free_port()
        bodies_file = stack.enter_context(tempfile.NamedTemporaryFile("w", suffix=".json"))
        json.dump(bodies, bodies_file)
        bodies_file.flush()
        command = server_command(target, port, bodies_file.name, args)
        process = stack.enter_context(serving(command, port, args.startup_timeout))
        answers = {method: fetch(port, method) for method in METHODS}
        for method, body in answers.items():
            bodies.setdefault(method, body.decode())
        servers[target] = Server(port, process.pid, {m: len(b) for m, b in answers.items()})
    return servers


def measure(servers: dict[str, Server], args: argparse.Namespace) -> dict[str, dict[str, dict]]:
    """Interleave rounds over targets and methods, so load from other processes on the machine
    falls on all of them alike; summarize each row by the median over rounds."""
    rounds: dict[tuple[str, str], list[dict[str, float]]] = {}
    for index in range(args.rounds):
        print(f"round {index + 1}/{args.rounds} ...", file=sys.stderr, flush=True)
        for target, server in servers.items():
            for method in METHODS:
                figures = load(server.port, method, server.pid, args)
                rounds.setdefault((target, method), []).append(figures)
    results: dict[str, dict[str, dict]] = {target: {} for target in servers}
    for (target, method), runs in rounds.items():
        row = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        row["errors"] = sum(run["errors"] for run in runs)
        results[target][method] = row | {"bytes": servers[target].body_bytes[method]}
    return results


def report(results: dict[str, dict[str, dict]], args: argparse.Namespace) -> None:
    print(
        f"\nconcurrency {args.concurrency}; per row the median of {args.rounds} rounds of "
        f"{args.duration:g} s measured after {args.warmup:g} s warm-up; errors summed; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"{'target':8} {'method':16} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6} "
        f"{'bytes':>6} {'srv us/req':>10} {'srv CPU':>7} {'srv wait':>8} {'cli CPU':>7} "
        f"{'cli wait':>8}"
    )
    for target, by_method in results.items():
        for method, r in by_method.items():
            print(
                f"{target:8} {method:16} {r['rps']:8.0f} {r['p50_ms']:7.2f} {r['p99_ms']:7.2f} "
                f"{r['errors']:6d} {r['bytes']:6d} {r['server_us_per_request']:10.0f} "
                f"{r['server_cpu_frac']:7.0%} {r['server_wait_frac']:8.0%} "
                f"{r['client_cpu_frac']:7.0%} {r['client_wait_frac']:8.0%}"
            )
    print(
        "srv = the server, cli = the load generator; CPU = share of one core used, wait = share "
        "of the time runnable but waiting for a CPU"
    )
    busy = [
        f"{t} {m}"
        for t, rows in results.items()
        for m, r in rows.items()
        if max(r["server_wait_frac"], r["client_wait_frac"]) > BUSY_WAIT
    ]
    if busy:
        print(
            f"note: server or client was kept waiting for a CPU over {BUSY_WAIT:.0%} of the time "
            f"in {', '.join(busy)}: the machine is busy, so req/s and p99 there partly measure "
            "other processes; server us/req depends on that far less"
        )
    if "kvgate" in results and "sdk" in results:
        print(f"\nkvgate vs SDK (targets: req/s >= {RPS_TARGET}x, p99 <= {P99_TARGET}x):")
        for method in METHODS:
            ours, sdk = results["kvgate"][method], results["sdk"][method]
            rps, p99 = ours["rps"] / sdk["rps"], ours["p99_ms"] / sdk["p99_ms"]
            cpu = sdk["server_us_per_request"] / ours["server_us_per_request"]
            verdict = "met" if rps >= RPS_TARGET and p99 <= P99_TARGET else "NOT met"
            print(
                f"  {method:16} req/s {rps:5.2f}x  p99 {p99:5.2f}x  {verdict:7}  "
                f"(server CPU per request: SDK spends {cpu:.1f}x kvgate's)"
            )
    if "kvgate" in results and "bare" in results:
        for method in METHODS:
            share = results["kvgate"][method]["rps"] / results["bare"][method]["rps"]
            print(f"  {method:16} kvgate reaches {share:.0%} of the bare route's req/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds per row")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds per row")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="rows report the median round")
    parser.add_argument("--targets", default=",".join(TARGETS), help="comma-separated subset")
    parser.add_argument("--startup-timeout", type=float, default=180.0)
    parser.add_argument(
        "--gc-freeze", action="store_true", help="gc.freeze() the SDK and bare servers at startup"
    )
    parser.add_argument(
        "--workers", type=int, default=1, help="kvgate's API processes (`serve --workers`)"
    )
    args = parser.parse_args()
    targets = [t for t in TARGETS if t in args.targets.split(",")]
    if targets[:1] == ["bare"]:
        parser.error("the bare route replays another target's bytes: add kvgate or sdk")
    with ExitStack() as stack:
        results = measure(start(targets, args, stack), args)
    report(results, args)


if __name__ == "__main__":
    main()
