"""A lean HTTP/1.1 keep-alive load generator, run in its own process.

httpx spends more CPU per request than a fast server does, so it would measure itself. This
client sends one pre-built request over `concurrency` raw asyncio connections, parses only the
status line and `Content-Length`, and reports its own CPU time so a reader can see it was not
the bottleneck. Usage (prints one JSON object):

    python -m benchmarks.loadgen --port 8000 --request-file req.bin --duration 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from dataclasses import dataclass, field


@dataclass
class Window:
    """The measured interval and what finished inside it."""

    start: float
    end: float
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    answered: int = 0  # every response, warm-up included (to price server CPU per request)


async def read_response(reader: asyncio.StreamReader) -> int:
    """Read one response off a keep-alive connection; return its status code."""
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = None
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
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
            window.answered += 1
            if sent >= window.start and done <= window.end:
                if status == 200:
                    window.latencies.append(done - sent)
                else:
                    window.errors += 1
    finally:
        writer.close()


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
    cpu_before = resource.getrusage(resource.RUSAGE_SELF)
    await asyncio.gather(*tasks)
    cpu_after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime - cpu_before.ru_stime)
    ordered = sorted(window.latencies)
    if not ordered:
        raise RuntimeError(f"no successful responses ({window.errors} errors)")
    return {
        "requests": len(ordered),
        "errors": window.errors,
        "answered": window.answered,
        "rps": len(ordered) / args.duration,
        "p50_ms": percentile(ordered, 0.50) * 1e3,
        "p99_ms": percentile(ordered, 0.99) * 1e3,
        "client_cpu_s": cpu,
        "client_cpu_frac": cpu / (time.perf_counter() - window.start),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--request-file", required=True, help="raw HTTP/1.1 request bytes")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--duration", type=float, default=5.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds first")
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
