"""Lean ASGI plumbing for the MCP endpoint: bounded body reads, one-shot responses, and
running work until the client disconnects (closing a stream is how MCP cancels)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Iterable, Mapping
from typing import Any, TypeVar

from starlette.types import Receive, Send

T = TypeVar("T")

JSON = b"application/json"
EVENT_STREAM = b"text/event-stream"


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


async def read_body(receive: Receive, limit: int, content_length: str | None) -> bytes:
    """The request body, refusing anything over ``limit`` bytes before or while reading."""
    if content_length is not None and content_length.isdigit() and int(content_length) > limit:
        raise BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def read_bounded(
    receive: Receive, headers: Mapping[str, str], limit: int, timeout_s: float
) -> bytes:
    """The body, within ``limit`` bytes (BodyTooLarge) and ``timeout_s`` (TimeoutError): a
    slow or oversized body costs its sender alone, on every front door."""
    async with asyncio.timeout(timeout_s):
        return await read_body(receive, limit, headers.get("content-length"))


async def send_response(
    send: Send,
    status: int,
    body: bytes = b"",
    content_type: bytes | None = JSON,
    headers: Iterable[tuple[bytes, bytes]] = (),
) -> None:
    raw = [(b"content-length", str(len(body)).encode())]
    if content_type is not None:
        raw.append((b"content-type", content_type))
    raw.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def start_stream(send: Send, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Open an SSE response; proxies are told not to buffer it (``X-Accel-Buffering: no``)."""
    raw = [
        (b"content-type", EVENT_STREAM),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
        *headers,
    ]
    await send({"type": "http.response.start", "status": 200, "headers": raw})


async def send_chunk(send: Send, chunk: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": chunk, "more_body": more})


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Run ``work``; if the client disconnects first, cancel it and raise ClientGone."""
    task: asyncio.Future[T] = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    raise ClientGone


async def _disconnected(receive: Receive) -> Any:
    while (await receive())["type"] != "http.disconnect":
        pass
