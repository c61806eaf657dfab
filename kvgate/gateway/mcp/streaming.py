"""Server-Sent Events: a tools/call's progress then its result, and subscriptions/listen.

Each SSE response belongs to one request (2026-07-28 has no session-wide stream): progress
notifications first, the JSON-RPC response last. A listen stream is acknowledged first, then
carries only the list changes the client opted in to, tagged with its subscription id, with
comment lines as keep-alives in between.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from starlette.types import Send

from kvgate.gateway.calls.errors import DeadlineExceeded
from kvgate.gateway.http import io as http_io
from kvgate.gateway.mcp.errors import protocol_error
from kvgate.gateway.mcp.tool_runner import Items, Progress
from kvgate.protocol.errors import INTERNAL_ERROR, ProtocolError
from kvgate.protocol.jsonrpc import encode_error, encode_notification, encode_result
from kvgate.protocol.jsonrpc_types import RequestId
from kvgate.protocol.modern import SUBSCRIPTION_ID_KEY

logger = logging.getLogger("kvgate.mcp")
KEEPALIVE = b":\n\n"
STREAM_CLOSE_GRACE_S = 5.0  # to send a stream's last event to a reader that may have stalled

LIST_CHANGED = {
    "toolsListChanged": "notifications/tools/list_changed",
    "promptsListChanged": "notifications/prompts/list_changed",
    "resourcesListChanged": "notifications/resources/list_changed",
}


def sse_event(data: bytes) -> bytes:
    return b"event: message\ndata: " + http_io.line_safe(data) + b"\n\n"


async def send_sse(
    send: Send,
    events: AsyncGenerator[bytes],
    request_id: RequestId,
    deadline: float,
    timeout_s: float,
) -> ProtocolError | None:
    """Send an SSE response until ``deadline`` (loop time; ``timeout_s`` after the call
    began, which the error names). A failure or the deadline
    mid-stream still ends it with an error event (returned, so the caller can count it).
    Sends wait on this client alone (uvicorn's flow control), so a reader that stops reading
    stalls only its own stream, and the deadline still ends it."""
    error = None
    async with aclosing(events):
        await http_io.start_stream(send)
        try:
            async with asyncio.timeout_at(deadline):
                async for chunk in events:
                    await http_io.send_chunk(send, chunk)
        except TimeoutError:
            error = protocol_error(DeadlineExceeded(timeout_s))
        except Exception:
            logger.exception("internal error while streaming request %r", request_id)
            error = ProtocolError(INTERNAL_ERROR, "Internal error")
        try:
            async with asyncio.timeout(STREAM_CLOSE_GRACE_S):
                if error is not None:
                    error.request_id = request_id
                    await http_io.send_chunk(send, sse_event(encode_error(error)))
                await http_io.send_chunk(send, b"", more=False)
        except TimeoutError:  # the reader has stopped reading: let the server drop it
            logger.info("dropping stream %r: its reader stopped reading", request_id)
    return error


async def tool_call_events(
    request_id: RequestId,
    progress_token: str | int,
    items: Items,
    shape: Callable[[dict[str, Any]], dict[str, Any]],
) -> AsyncGenerator[bytes]:
    """Progress notifications as text arrives (progress = tokens so far), then the result.
    Closing this closes ``items`` at once (which aborts the generation)."""
    async with aclosing(items):
        async for item in items:
            if isinstance(item, Progress):
                params = {
                    "progressToken": progress_token,
                    "progress": item.tokens,
                    "message": item.text,
                }
                yield sse_event(encode_notification("notifications/progress", params))
            else:
                yield sse_event(encode_result(request_id, shape(item)))


def accepted_filter(requested: Any) -> dict[str, Any]:
    """The subset of a listen filter this server honours: the three list-changed kinds."""
    if not isinstance(requested, dict):
        return {}
    return {key: True for key in LIST_CHANGED if requested.get(key) is True}


async def listen_events(
    request_id: RequestId,
    honoured: dict[str, Any],
    versions: AsyncIterator[str],
    keepalive_s: float,
    max_s: float,
    server_info: dict[str, str],
) -> AsyncGenerator[bytes]:
    """Acknowledge, then one notification per opted-in list kind on every catalog change.

    Ends gracefully (a result tagged with the subscription id) after ``max_s``, so no stream
    is held forever; closing the connection ends it at once.
    """
    tag = {SUBSCRIPTION_ID_KEY: request_id}
    ack = {"_meta": tag, "notifications": honoured}
    yield sse_event(encode_notification("notifications/subscriptions/acknowledged", ack))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_s
    pending: asyncio.Task[str] | None = None
    try:
        while (left := deadline - loop.time()) > 0:
            if pending is None:
                pending = asyncio.ensure_future(anext(versions))
            done, _ = await asyncio.wait((pending,), timeout=min(keepalive_s, left))
            if not done:
                yield KEEPALIVE
                continue
            try:
                pending.result()
            except StopAsyncIteration:
                break
            pending = None
            for key in honoured:
                yield sse_event(encode_notification(LIST_CHANGED[key], {"_meta": tag}))
        closing = {
            "resultType": "complete",
            "_meta": {**tag, "io.modelcontextprotocol/serverInfo": server_info},
        }
        yield sse_event(encode_result(request_id, closing))
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.wait((pending,))  # settles it without raising into this task
        if hasattr(versions, "aclose"):
            await versions.aclose()
