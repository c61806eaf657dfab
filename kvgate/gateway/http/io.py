"""Lean ASGI plumbing for the MCP endpoint: bounded body reads, one-shot responses, and
running work until the client disconnects (closing a stream is how MCP cancels)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Mapping
from contextvars import ContextVar
from typing import Any, TypeVar

from starlette.types import Receive, Scope, Send

T = TypeVar("T")

JSON = b"application/json"
EVENT_STREAM = b"text/event-stream"
# Who served the request (fleet mode: the upstream's URL): the backend notes it once it has
# chosen, in a holder the door made for the request (the call itself runs in a task of its
# own, whose context is a copy); the response's head carries it as X-Kvgate-Upstream.
SERVED_BY: ContextVar[list[bytes] | None] = ContextVar("kvgate_served_by", default=None)
UPSTREAM_HEADER = b"x-kvgate-upstream"


def track_served_by() -> None:
    """Begin noting who serves this request (a door calls it as the request begins)."""
    SERVED_BY.set([])


def note_served_by(url: str) -> None:
    """The backend chose ``url`` for the request's call (the first one noted is sent)."""
    holder = SERVED_BY.get()
    if holder is not None and not holder:
        holder.append(url.encode())


def _served_by(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    holder = SERVED_BY.get()
    if holder:
        raw.append((UPSTREAM_HEADER, holder[0]))
    return raw


def media_type(content_type: str | None) -> str:
    """``"Application/JSON; charset=utf-8"`` → ``"application/json"``: the type and subtype
    alone, compared exactly (``application/jsonp`` or ``json-seq`` is not JSON)."""
    return (content_type or "").split(";", 1)[0].strip(" \t").lower()


def accepted(accept: str) -> frozenset[str]:
    """The media ranges an ``Accept`` header welcomes: those not weighted ``q=0``."""
    welcome = set()
    for item in accept.split(","):
        kind, *params = item.split(";")
        refused = False
        for param in params:
            key, _, value = param.partition("=")
            if key.strip(" \t").lower() == "q":
                try:
                    refused = float(value.strip(" \t")) <= 0
                except ValueError:
                    refused = True  # a malformed weight welcomes nothing
        if not refused and (kind := kind.strip(" \t").lower()):
            welcome.add(kind)
    return frozenset(welcome)


def accepts(accept: str | None, kind: str) -> bool:
    """Whether ``kind`` was asked for by name, not weighted ``q=0``; ``*/*`` does not count:
    it means "any one answer", not "stream me"."""
    return accept is not None and kind in accepted(accept)


# Characters that JSON lets stand raw inside strings but that line readers split on (Python's
# str.splitlines, so httpx's aiter_lines and clients built on it): escaped in an SSE event's
# JSON, the same value, never a cut event. In UTF-8 these byte runs mean nothing else.
LINE_SEPARATORS = (
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
    (b"\xc2\x85", b"\\u0085"),
)


def line_safe(json_text: bytes) -> bytes:
    """``json_text`` with U+2028, U+2029 and U+0085 written as escapes."""
    if b"\xe2\x80" not in json_text and b"\xc2\x85" not in json_text:
        return json_text
    for raw, escaped in LINE_SEPARATORS:
        json_text = json_text.replace(raw, escaped)
    return json_text


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    pass


def header_map(scope: Scope) -> dict[str, str]:
    """A request's headers by name (ASGI servers lower-case names; RFC 9110 5.5: whitespace
    around a value is not data). Last wins: a repeated header that decides anything is refused
    before this (``kvgate.gateway.http.security.repeated``)."""
    return {k.decode("latin-1"): v.decode("latin-1").strip(" \t") for k, v in scope["headers"]}


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
    await send({"type": "http.response.start", "status": status, "headers": _served_by(raw)})
    await send({"type": "http.response.body", "body": body})


async def start_stream(send: Send, headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Open an SSE response; proxies are told not to buffer it (``X-Accel-Buffering: no``)."""
    raw = [
        (b"content-type", EVENT_STREAM),
        (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no"),
        *headers,
    ]
    await send({"type": "http.response.start", "status": 200, "headers": _served_by(raw)})


async def send_chunk(send: Send, chunk: bytes, more: bool = True) -> None:
    await send({"type": "http.response.body", "body": chunk, "more_body": more})


async def before(deadline: float, work: Awaitable[T]) -> T:
    """``work``, or TimeoutError at ``deadline`` (loop time): a call's deadline, on every
    front door."""
    async with asyncio.timeout_at(deadline):
        return await work


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> T:
    """Run ``work``; if the client disconnects first, cancel it and raise ClientGone.

    ``work`` runs in the caller's task and only the watcher is a task of its own: the
    disconnect cancels the caller, as ``asyncio.timeout`` does (one task per call less, and
    no ``asyncio.wait``, on every front door's hot path)."""
    current = asyncio.current_task()
    assert current is not None
    gone, running = False, True

    def on_watcher_done(watcher: asyncio.Future[Any]) -> None:
        nonlocal gone
        # ``running``: a callback already scheduled when ``work`` ended must not cancel the
        # caller at its next await.
        if running and not watcher.cancelled() and watcher.exception() is None:
            gone = True
            current.cancel()

    watcher = asyncio.ensure_future(_disconnected(receive))
    watcher.add_done_callback(on_watcher_done)
    try:
        return await work
    except asyncio.CancelledError:
        if gone and current.uncancel() == 0:  # ours alone, not a cancel from outside
            raise ClientGone from None
        raise
    finally:
        running = False
        watcher.cancel()


async def _disconnected(receive: Receive) -> Any:
    while (await receive())["type"] != "http.disconnect":
        pass
