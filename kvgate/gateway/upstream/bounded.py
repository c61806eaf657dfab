"""Reading an upstream within bounds: its SSE stream as lines, and any other answer's body.

An upstream is outside data. Its stream is split into lines on ``\\n`` (a ``\\r`` before it
dropped) and nothing else — ``str.splitlines`` and httpx's ``aiter_lines`` also break on
U+2028, U+2029 and U+0085, which are text inside a JSON string. A line over
``MAX_LINE_BYTES``, an event over ``MAX_EVENT_BYTES``, a stream over its byte budget or its
line budget (lines that carry no event, comments and blank lines, count too), bytes that are
not UTF-8 or a body in a content coding (decoded, a gzip bomb has no bound) are a
``wire.StreamError``: the reply is malformed. Bodies that are not streams (an error answer,
``/v1/models``, ``/health``, ``/metrics``) are read up to a limit.

What the gateway holds per call is thus at most one line (1 MiB) and the text relayed so
far (bounded by the stream's budget), whatever the upstream sends. What it spends is bounded
too: a megabyte read at once may hold half a million two-byte lines, so the lines are
handed on ``YIELD_LINES`` at a time between turns of the event loop, never all in one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import orjson

from kvgate.gateway.upstream.http1 import Pool, Response
from kvgate.gateway.upstream.wire import StreamError

MAX_LINE_BYTES = 1 << 20
MAX_EVENT_BYTES = 1 << 20
MAX_BODY_BYTES = 1 << 20  # an answer that is not a stream: /v1/models, /health, an error
# A /metrics page: vLLM's is ~100-300 KiB per engine. Read whole, decoded, then searched,
# a page costs about three times its size at once.
MAX_METRICS_BYTES = 4 << 20
# A stream may carry this much, plus this much per token asked for (a chunk with 20 top
# logprobs is ~2 KiB), comments and keep-alives included.
STREAM_BASE_BYTES = 1 << 20
STREAM_BYTES_PER_TOKEN = 16 << 10
# A stream may carry this many lines per event it may carry (an event is a data line and a
# blank one; the rest is room for comments, ``event:`` and ``id:`` lines, keep-alives).
LINES_PER_EVENT = 4
YIELD_LINES = 256
# Headers every upstream request carries: no content coding (identity bodies only).
HEADERS = {"accept-encoding": "identity"}


def stream_budget(max_tokens: int) -> int:
    return STREAM_BASE_BYTES + STREAM_BYTES_PER_TOKEN * max_tokens


def coded(response: Response) -> str | None:
    """The response's content coding, unless it is none (``identity``)."""
    coding = response.headers.get("content-encoding", "").strip().lower()
    return coding if coding not in ("", "identity") else None


async def sse_lines(
    chunks: AsyncIterator[bytes],
    budget: int,
    max_lines: int,
    max_line: int = MAX_LINE_BYTES,
    max_event: int = MAX_EVENT_BYTES,
) -> AsyncGenerator[str]:
    """The stream's lines (without their ends), each decoded as UTF-8: at most
    ``max_lines`` of them in at most ``budget`` bytes."""
    buffer = bytearray()
    total = event = lines = 0
    async for piece in chunks:
        total += len(piece)
        if total > budget:
            raise StreamError(f"malformed stream from the upstream: over {budget} bytes")
        scanned = len(buffer)
        buffer += piece
        start = 0
        while (end := buffer.find(b"\n", max(start, scanned))) >= 0:
            line = buffer[start : end - 1 if end > start and buffer[end - 1] == 13 else end]
            start = end + 1
            event = event + len(line) if line else 0
            if len(line) > max_line or event > max_event:
                raise StreamError(
                    f"malformed stream from the upstream: a line or event over {max_line} bytes"
                )
            lines += 1
            if lines > max_lines:
                raise StreamError(f"malformed stream from the upstream: over {max_lines} lines")
            if lines % YIELD_LINES == 0:
                await asyncio.sleep(0)  # the loop's other work runs between these lines
            yield _text(line)
        del buffer[:start]
        if len(buffer) > max_line:
            raise StreamError(
                f"malformed stream from the upstream: a line or event over {max_line} bytes"
            )
    if buffer:
        yield _text(buffer)


def _text(line: bytearray) -> str:
    try:
        return line.decode()
    except UnicodeDecodeError:
        raise StreamError("malformed stream from the upstream: not UTF-8") from None


async def read_within(response: Response, limit: int) -> bytes | None:
    """The response body, or None once it runs past ``limit`` bytes (the rest unread) or
    comes in a content coding."""
    if coded(response) is not None:
        return None
    length = response.content_length
    if length is not None and length <= limit:  # one read, as the socket delivers it
        return await response.read()
    data = bytearray()
    async for piece in response.chunks():
        data += piece
        if len(data) > limit:
            return None
    return bytes(data)


async def read_head(response: Response, limit: int) -> bytes:
    """At most the first ``limit`` bytes of the body (an error answer's message)."""
    if coded(response) is not None:
        return b""
    data = bytearray()
    async for piece in response.chunks():
        data += piece
        if len(data) >= limit:
            break
    return bytes(data[:limit])


async def models(url: str, timeout_s: float, headers: dict[str, str]) -> Any:
    """``GET /v1/models``'s JSON, read up to ``MAX_BODY_BYTES`` (ValueError beyond, or for
    a non-2xx answer), over a connection of its own, closed after: the URL is not a member
    yet (a probe at startup, or an address that may join)."""
    pool = Pool(url, {**HEADERS, **headers}, timeout_s)
    try:
        async with asyncio.timeout(timeout_s):
            response = await pool.request("GET", "/v1/models")
            try:
                if not 200 <= response.status < 300:
                    raise ValueError(f"/v1/models answered HTTP {response.status}")
                data = await read_within(response, MAX_BODY_BYTES)
            finally:
                response.close()
    finally:
        await pool.aclose()
    if not data:
        raise ValueError(f"/v1/models answered no JSON within {MAX_BODY_BYTES} bytes")
    return orjson.loads(data)
