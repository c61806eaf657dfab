"""An upstream that writes its answers byte for byte, framing included: a real process
(asyncio streams, no HTTP library) for what the fleet's own HTTP/1.1 client does with framing
no HTTP server library would send. A completion's prompt (or a chat's last message) names the
answer: one written in one piece (``ANSWERS``: a second response pipelined after the first,
bytes past the Content-Length, …), a flood (``FLOODS``: a header line that never ends, …), or
one of ``evil_upstream.STREAMS`` as a chunked body; anything else is a short valid stream.
``GET /v1/models`` answers as an engine does; ``--health`` and ``--metrics`` name what
``/health`` and ``/metrics`` answer (``PAGES``). A flood ends when the peer hangs up or after
``FLOOD_BYTES``. Run: ``python -m tests.gateway.upstream.raw_upstream --host H --port P
[--health PAGE] [--metrics PAGE]``."""

from __future__ import annotations

import argparse
import asyncio
import functools
from collections.abc import AsyncIterator, Callable

import orjson

from kvgate.gateway.upstream.bounded import MAX_METRICS_BYTES
from tests.gateway.upstream.evil_upstream import MODEL, STREAMS, valid

FLOOD_BYTES = 1 << 30
BLOCK = b"a" * (64 << 10)
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
CHUNKED_HEAD = SSE_HEAD + b"transfer-encoding: chunked\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"


def chunked(pieces: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces if piece)


def sized(
    body: bytes, head: bytes = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
) -> bytes:
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


GOOD = b"".join(valid("GOOD-"))
SMUGGLED = b"".join(valid("SMUGGLED-"))
EXTRA = sized(SMUGGLED, b"HTTP/1.1 200 OK\r\n")  # a second answer, with no content type
# name -> the bytes written, all at once
ANSWERS = {
    "good": CHUNKED_HEAD + chunked([GOOD]) + LAST_CHUNK,
    "pipelined": CHUNKED_HEAD + chunked([GOOD]) + LAST_CHUNK + EXTRA,
    "pipelined-sized": sized(GOOD, SSE_HEAD) + EXTRA,
    "longer-than-length": sized(GOOD, SSE_HEAD) + SMUGGLED,
    "length-and-chunked": SSE_HEAD
    + b"content-length: 5\r\ntransfer-encoding: chunked\r\n\r\n"
    + chunked([GOOD])
    + LAST_CHUNK,
}
# name -> (the head written once, the block written after it until the peer hangs up)
FLOODS = {
    "endless-header": (SSE_HEAD + b"x-endless: ", BLOCK),
    "endless-headers": (SSE_HEAD, b"x-h: a\r\n" * 8192),
    "endless-trailer": (CHUNKED_HEAD + chunked([GOOD]) + b"0\r\nx-trailer: ", BLOCK),
    "endless-chunk-extension": (CHUNKED_HEAD + b"1;", BLOCK),
}
LATE = "late-extra"  # a good answer, then a second one on the idle connection 50 ms later


@functools.cache
def huge_metrics() -> bytes:
    """A /metrics page just under the scrape's limit, every line a series it reads."""
    line = b'vllm:num_requests_waiting{engine="%d"} 0\n'
    lines, size, i = [], 0, 0
    while size + len(line) + 16 < MAX_METRICS_BYTES:
        lines.append(line % i)
        size += len(lines[-1])
        i += 1
    return b"".join(lines)


# /health and /metrics: name -> their answer, or a flood's name
PAGES: dict[str, Callable[[], bytes | str]] = {
    "ok": lambda: sized(b"vllm:num_requests_waiting 0\n", b"HTTP/1.1 200 OK\r\n"),
    "endless-header": lambda: "endless-header",
    "huge": lambda: sized(huge_metrics(), b"HTTP/1.1 200 OK\r\n"),
}
MODELS = sized(orjson.dumps({"object": "list", "data": [{"id": MODEL, "max_model_len": 4096}]}))


async def flood(writer: asyncio.StreamWriter, head: bytes, block: bytes) -> None:
    writer.write(head)
    sent = 0
    while sent < FLOOD_BYTES:
        writer.write(block)
        await writer.drain()
        sent += len(block)


async def stream(writer: asyncio.StreamWriter, pieces: AsyncIterator[bytes]) -> None:
    """``evil_upstream``'s stream as a chunked body (its empty pieces left out)."""
    writer.write(CHUNKED_HEAD)
    sent = 0
    async for piece in pieces:
        writer.write(chunked([piece]))
        await writer.drain()
        sent += len(piece)
        if sent > FLOOD_BYTES:
            return
    writer.write(LAST_CHUNK)


async def answer(writer: asyncio.StreamWriter, name: str) -> None:
    if name in FLOODS:
        await flood(writer, *FLOODS[name])
    elif name in STREAMS:
        await stream(writer, STREAMS[name]())
    elif name == LATE:
        writer.write(ANSWERS["good"])
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(EXTRA)
    else:
        writer.write(ANSWERS.get(name, ANSWERS["good"]))
    await writer.drain()


def scenario(body: bytes) -> str:
    request = orjson.loads(body)
    named = request["messages"][-1]["content"] if "messages" in request else request["prompt"]
    return named if isinstance(named, str) else "good"


async def connection(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pages: dict[str, str]
) -> None:
    """Answer the connection's requests in turn until the peer hangs up."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            method, path = lines[0].split(b" ")[:2]
            length = next(
                (int(h.split(b":")[1]) for h in lines if h.lower().startswith(b"content-length:")),
                0,
            )
            body = await reader.readexactly(length)
            route = path.decode().split("?")[0]
            if method == b"POST":
                await answer(writer, scenario(body))
            elif route in ("/health", "/metrics"):
                page = PAGES[pages[route]]()
                await (answer(writer, page) if isinstance(page, str) else _write(writer, page))
            else:
                await _write(writer, MODELS if route == "/v1/models" else PAGES["ok"]())
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        pass
    finally:
        writer.close()


async def _write(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    await writer.drain()


async def serve(host: str, port: int, pages: dict[str, str]) -> None:
    server = await asyncio.start_server(
        lambda r, w: connection(r, w, pages), host, port, limit=1 << 20
    )
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--health", choices=PAGES, default="ok")
    parser.add_argument("--metrics", choices=PAGES, default="ok")
    given = parser.parse_args()
    asyncio.run(serve(given.host, given.port, {"/health": given.health, "/metrics": given.metrics}))
