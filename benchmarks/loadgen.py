"""A lean HTTP/1.1 keep-alive load generator, run in its own process.

httpx spends more CPU per request than a fast server does, so it would measure itself. This
client sends one pre-built request over `concurrency` raw asyncio connections, parses only the
status line and `Content-Length`, and reports over the measured window its own and the server's
CPU share and the share of time each waited for a CPU while runnable (a busy machine shows up
there, not hidden in the figures). Usage (prints one JSON object):

    python -m benchmarks.loadgen --port 8000 --request-file req.bin --duration 5 --watch-pid PID
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Window:
    """The measured interval and what finished inside it."""

    start: float
    end: float
    latencies: list[float] = field(default_factory=list)
    errors: int = 0


async def read_response(reader: asyncio.StreamReader) -> int:
    """Read one response (a fixed length or chunked body) off a keep-alive connection; return
    its status code."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length, chunked = None, False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = value.strip().lower() == b"chunked"
    if chunked:  # a stream: read its chunks to the last, empty one
        while size := int((await reader.readuntil(b"\r\n"))[:-2].split(b";")[0], 16):
            await reader.readexactly(size + 2)
        await reader.readuntil(b"\r\n")
        return status
    if length is None:
        raise RuntimeError(f"response without Content-Length: {head!r}")
    await reader.readexactly(length)
    return status


async def connection(host: str, port: int, request: bytes, window: Window) -> None:
    """Send the request back to back on one connection until the window closes."""
    reader, writer = await asyncio.open_connection(host, port)
    clock = time.perf_counter
    try:
        while (sent := clock()) < window.end:
            writer.write(request)
            status = await read_response(reader)
            done = clock()
            if sent >= window.start and done <= window.end:
                if status == 200:
                    window.latencies.append(done - sent)
                else:
                    window.errors += 1
    finally:
        writer.close()


def cpu_and_wait(pid: int | str) -> tuple[float, float]:
    """CPU seconds of a whole process so far, and seconds its main thread spent runnable but
    waiting for a CPU (Linux /proc)."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    waited_ns = int(Path(f"/proc/{pid}/schedstat").read_text().split()[1])
    return cpu, waited_ns / 1e9


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants (a server's worker processes)."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            queue.extend(int(child) for child in task.read_text().split())
    return found


def _tree_cpu_and_wait(pid: int) -> tuple[float, float]:
    """``cpu_and_wait`` summed over the process and its descendants."""
    figures = [cpu_and_wait(p) for p in tree(pid)]
    return sum(f[0] for f in figures), sum(f[1] for f in figures)


def _snapshot(pids: Iterable[int]) -> dict[int, tuple[float, float]]:
    """``cpu_and_wait`` of each distinct process (with its descendants) once (a process
    watched under two names — the server in the load generator's own process — reads the
    same at both)."""
    return {pid: _tree_cpu_and_wait(pid) for pid in set(pids)}


def percentile(ordered: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending list."""
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def run(args: argparse.Namespace, request: bytes) -> dict[str, float]:
    begin = time.perf_counter()
    window = Window(start=begin + args.warmup, end=begin + args.warmup + args.duration)
    tasks = [
        asyncio.create_task(connection(args.host, args.port, request, window))
        for _ in range(args.concurrency)
    ]
    await asyncio.sleep(args.warmup)
    watched = {"client": os.getpid()} | ({"server": args.watch_pid} if args.watch_pid else {})
    before = _snapshot(watched.values())
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - window.start
    ordered = sorted(window.latencies)
    if not ordered:
        raise RuntimeError(f"no successful responses ({window.errors} errors)")
    figures = {
        "requests": len(ordered),
        "errors": window.errors,
        "rps": len(ordered) / args.duration,
        "p50_ms": percentile(ordered, 0.50) * 1e3,
        "p99_ms": percentile(ordered, 0.99) * 1e3,
    }
    after = _snapshot(watched.values())
    for name, pid in watched.items():
        cpu, waited = (a - b for a, b in zip(after[pid], before[pid], strict=True))
        figures[f"{name}_cpu_frac"] = cpu / elapsed
        figures[f"{name}_wait_frac"] = waited / elapsed
        figures[f"{name}_us_per_request"] = cpu / len(ordered) * 1e6
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--request-file", required=True, help="raw HTTP/1.1 request bytes")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds first")
    parser.add_argument(
        "--watch-pid",
        type=int,
        help="the server's process id, to report its CPU (and its children's)",
    )
    args = parser.parse_args()
    with open(args.request_file, "rb") as file:
        request = file.read()
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(run(args, request))
    else:
        result = uvloop.run(run(args, request))
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
