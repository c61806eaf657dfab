"""The benchmark's load generator counts what a real keep-alive server answers."""

import argparse
import asyncio
import os

import pytest

from benchmarks.loadgen import percentile, run

REQUEST = b"POST /mcp HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"


async def serve(*responses: bytes) -> tuple[asyncio.Server, int, list[int]]:
    """A keep-alive server cycling through `responses`; counts requests seen."""
    seen = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(2)
                writer.write(responses[seen[0] % len(responses)])
                seen[0] += 1
        except asyncio.IncompleteReadError:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], seen


def options(port: int, watch_pid: int | None = None) -> argparse.Namespace:
    return argparse.Namespace(
        host="127.0.0.1", port=port, concurrency=4, duration=0.3, warmup=0.1, watch_pid=watch_pid
    )


async def test_counts_successes_within_the_window() -> None:
    server, port, seen = await serve(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
    async with server:
        figures = await run(options(port), REQUEST)
    assert figures["errors"] == 0
    assert 0 < figures["requests"] < seen[0]  # warm-up requests are not counted
    assert figures["rps"] == pytest.approx(figures["requests"] / 0.3)
    assert 0 < figures["p50_ms"] <= figures["p99_ms"]
    assert 0 <= figures["client_wait_frac"] < 1
    assert "server_cpu_frac" not in figures  # no server process to watch


async def test_watches_the_server_process() -> None:
    server, port, _ = await serve(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
    async with server:  # served from this very process, so it is busy the whole window
        figures = await run(options(port, watch_pid=os.getpid()), REQUEST)
    assert 0.3 < figures["server_cpu_frac"] < 1.5
    assert figures["server_cpu_frac"] == figures["client_cpu_frac"]
    assert figures["server_us_per_request"] == pytest.approx(
        figures["server_cpu_frac"] * 0.3e6 / figures["requests"], rel=0.2
    )


async def test_non_200_answers_are_errors() -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"
    bad = b"HTTP/1.1 400 Bad Request\r\nContent-Length: 2\r\n\r\n{}"
    server, port, _ = await serve(ok, bad)
    async with server:
        figures = await run(options(port), REQUEST)
    assert figures["errors"] > 0
    assert abs(figures["errors"] - figures["requests"]) <= 4 + 1  # alternating, 4 connections


async def test_fails_when_nothing_succeeds() -> None:
    server, port, _ = await serve(b"HTTP/1.1 503 Busy\r\nContent-Length: 2\r\n\r\n{}")
    async with server:
        with pytest.raises(RuntimeError, match="no successful responses"):
            await run(options(port), REQUEST)


async def test_reads_chunked_answers_and_refuses_bodies_of_no_length() -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n"
    server, port, _ = await serve(chunked)
    async with server:
        figures = await run(options(port), REQUEST)
    assert figures["requests"] > 0 and figures["errors"] == 0
    server, port, _ = await serve(b"HTTP/1.1 200 OK\r\n\r\n{}")
    async with server:
        with pytest.raises(RuntimeError, match="Content-Length"):
            await run(options(port), REQUEST)


def test_percentile_is_nearest_rank() -> None:
    ordered = [float(i) for i in range(1, 101)]
    assert percentile(ordered, 0.50) == 51.0
    assert percentile(ordered, 0.99) == 100.0
    assert percentile([7.0], 0.99) == 7.0
