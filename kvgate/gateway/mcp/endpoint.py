"""The MCP endpoint (``POST /mcp``): the request pipeline of the Streamable HTTP binding.

In order: HTTP method → Origin/Host → body size → Content-Type → Accept → JSON-RPC parse →
notification (202) → era from ``MCP-Protocol-Version`` → modern envelope and header checks
(or legacy checks) → method table → handler. Catalog results are pre-serialized bytes spliced
around the request id; tool calls run on the engine, as JSON or as SSE when the caller sent a
``progressToken`` and accepts ``text/event-stream``. A call that ``kvgate.gateway.tasks`` makes a task
(the Tasks extension) is answered with its handle at once; ``tasks/*`` are answered there too.

The steps both doors share are ``kvgate.gateway.calls.lifecycle``'s: Origin/Host, the body within
its size and time, its media type; a tools/call is admitted there (the client's concurrency
slot, the tenant's budget), refused (503) when the backend is at capacity — its SSE response
starts only once the call is admitted — and cancelled at its deadline (``kvgate.gateway.mcp.deadline``
lets ``_meta`` shorten it). Failures are call errors, worded for MCP by ``kvgate.gateway.mcp.errors``.
Listen streams are capped. Each SSE response is its own task whose sends wait on that client
only, so a reader that stops reading stalls nothing else (and its deadline still ends it).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from starlette.types import Receive, Scope, Send

from kvgate.gateway.auth.challenge import Challenge
from kvgate.gateway.auth.identity import current_tenant
from kvgate.gateway.auth.middleware import authorize_call
from kvgate.gateway.calls.admission import ConcurrencyLimit, listen_limited
from kvgate.gateway.calls.errors import CallError, Rejected
from kvgate.gateway.calls.lifecycle import Lifecycle
from kvgate.gateway.catalog.catalog import Catalog, CatalogHolder
from kvgate.gateway.catalog.discovery_cache import DiscoveryCache
from kvgate.gateway.http import io as http_io
from kvgate.gateway.http.security import repeated
from kvgate.gateway.mcp.deadline import call_timeout_s
from kvgate.gateway.mcp.errors import http_status, protocol_error
from kvgate.gateway.mcp.streaming import (
    STREAM_CLOSE_GRACE_S,
    accepted_filter,
    listen_events,
    send_sse,
    tool_call_events,
)
from kvgate.gateway.mcp.tool_runner import Items, Progress, ToolRunner
from kvgate.gateway.ops import access_log, tracing
from kvgate.gateway.ops.metrics import Metrics
from kvgate.gateway.settings import Settings
from kvgate.gateway.tasks import methods as task_methods
from kvgate.gateway.tasks.tasks import Tasks
from kvgate.protocol import jsonrpc
from kvgate.protocol.errors import (
    INTERNAL_ERROR,
    RATE_LIMITED,
    REQUEST_TIMEOUT,
    SERVER_OVERLOADED,
    ProtocolError,
    header_mismatch,
    invalid_params,
)
from kvgate.protocol.headers import check_param_headers, is_routing_header
from kvgate.protocol.jsonrpc_types import Message, RequestId
from kvgate.protocol.methods import (
    CATALOG_METHODS,
    LEGACY_METHODS,
    MODERN_METHODS,
    TASK_METHODS,
    check_method,
)
from kvgate.protocol.modern import check_legacy_meta, check_modern_request
from kvgate.protocol.results import complete
from kvgate.protocol.tasks import check_listen_filter, create_task_result, declares_tasks
from kvgate.protocol.versions import Era, era_of, negotiate_legacy

logger = logging.getLogger("kvgate.mcp")

ALLOW_POST = [(b"allow", b"POST")]
CLOSE = [(b"connection", b"close")]
MCP_PATH = "/mcp"
LISTEN_KEY = "listen"  # every listen stream counts against one server-wide cap  # to send a stream's last event to a reader that may have stalled
ACCEPTABLE = ("application/json", "text/event-stream", "*/*", "application/*", "text/*")
REFUSAL_CODES = frozenset((SERVER_OVERLOADED, RATE_LIMITED, REQUEST_TIMEOUT))
METHOD_LABELS = MODERN_METHODS | LEGACY_METHODS  # anything else is counted as "unknown"
MRTR_RETRY_PARAMS = frozenset(("inputResponses", "requestState"))  # caching.mdx: MUST NOT cache


class McpEndpoint:
    """An ASGI app for the MCP endpoint path."""

    def __init__(
        self,
        settings: Settings,
        served: CatalogHolder,
        tools: ToolRunner,
        cache: DiscoveryCache,
        metrics: Metrics,
        versions: Callable[[], AsyncIterator[str]],
        calls: Lifecycle,
        tasks: Tasks,
    ) -> None:
        """``served`` holds the catalog being served (the reloader swaps it); ``versions``
        yields each catalog version this process starts serving (what listen streams follow);
        ``calls`` is the lifecycle every call goes through (shared with the other door);
        ``tasks`` makes and answers tasks (the Tasks extension)."""
        self.settings = settings
        self.served = served
        self.tools = tools
        self.cache = cache
        self.metrics = metrics
        self.versions = versions
        self.calls = calls
        self.tasks = tasks
        self.listens = ConcurrencyLimit(settings.max_listen_streams)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        http_io.track_served_by()
        started = time.perf_counter()
        headers = http_io.header_map(scope)
        label, tool, outcome = "invalid", None, "error"
        era, message = Era.LEGACY, None
        catalog = self.served.current  # one catalog for the whole request
        try:
            body = await self._transport_checks(scope, receive, headers)
            # a large body is parsed (and depth-checked) on a worker: other clients wait not
            message = await self.tools.generations.off_loop(
                len(body), jsonrpc.parse_message, body, self.settings.max_json_depth
            )
            if message.is_notification:  # no client notification needs an answer on HTTP
                label, outcome = "notification", "ok"
                await http_io.send_response(send, 202, content_type=None)
                return
            label = message.method if message.method in METHOD_LABELS else "unknown"
            era = era_of(headers.get("mcp-protocol-version"))
            if era is Era.MODERN:
                check_modern_request(message, headers)
            else:
                check_legacy_meta(message, headers.get("mcp-protocol-version"))
            check_method(message.method, era)
            authorize_call(scope, message.method)
            with tracing.request_span(
                message.method, message.params, message.meta, message.id, headers
            ):
                if message.method == "tools/call":
                    name = message.params.get("name")
                    tool = name if name in catalog.tool_specs else "unknown"
                    outcome = await self._tools_call(
                        catalog, message, era, headers, receive, send, len(body)
                    )
                elif message.method in TASK_METHODS:
                    result = await task_methods.answer(self.tasks, message, catalog.server_info)
                    body = jsonrpc.encode_result(message.request_id, result)
                    await http_io.send_response(send, 200, body)
                    outcome = "ok"
                elif message.method == "subscriptions/listen":
                    if self.listens.full(LISTEN_KEY):
                        raise listen_limited(self.settings.max_listen_streams)
                    with self.listens.hold(LISTEN_KEY):
                        outcome = await self._listen(catalog, message, receive, send)
                else:
                    body = await self._result(catalog, message, era)
                    await http_io.send_response(send, 200, body)
                    outcome = "ok"
        except CallError as error:
            wire = protocol_error(error)
            outcome = "rejected" if _rejection_reason(wire) else "error"
            await self._error(send, wire, error, era, message)
        except ProtocolError as error:
            if _rejection_reason(error):
                outcome = "rejected"
            await self._send_error(send, error.http_status(era is Era.MODERN), error, message)
        except http_io.ClientGone:
            outcome = "cancelled"
        except Exception:
            logger.exception("internal error answering %s", label)
            internal = ProtocolError(INTERNAL_ERROR, "Internal error")
            await self._send_error(send, 500, internal, message)
        finally:
            self.metrics.observe(label, tool, outcome, time.perf_counter() - started)
            access_log.called("mcp", label, tool, outcome)

    async def _transport_checks(
        self, scope: Scope, receive: Receive, headers: dict[str, str]
    ) -> bytes:
        """HTTP-level rules, in the spec's order (``Rejected`` or −32020); returns the body."""
        if scope["method"] != "POST":
            raise Rejected(405, "Method Not Allowed: the MCP endpoint takes POST only")
        duplicate = repeated(scope["headers"], lambda name: is_routing_header(name.decode()))
        self.calls.check_origin(scope["headers"])  # a repeated Host/Origin too: 400
        if duplicate is not None:
            raise header_mismatch(f"more than one {duplicate} header")
        body = await self.calls.read_body(receive, headers)
        if not _accepts_mcp(headers.get("accept")):
            raise Rejected(406, "Not Acceptable: accept application/json and text/event-stream")
        return body

    async def _result(self, catalog: Catalog, message: Message, era: Era) -> bytes:
        """The response bytes for every method answered in one piece (no engine work)."""
        method, params = message.method, message.params
        if method in CATALOG_METHODS or method == "server/discover":
            if "cursor" in params:
                raise invalid_params("Invalid cursor: this server returns every list in one page")
            if MRTR_RETRY_PARAMS.isdisjoint(params):
                body = await self.cache.get_or_build(
                    catalog.version,
                    method,
                    _params_hash(method, params),
                    lambda: catalog.result_bytes(method, params),
                )
            else:  # a retry's result depends on inputs outside the cache key: never cached
                body = catalog.result_bytes(method, params)
            return jsonrpc.splice_result(message.request_id, body)
        if method == "initialize":  # stateless: no session is minted, one sent is ignored
            result = {
                "protocolVersion": negotiate_legacy(params.get("protocolVersion")),
                "capabilities": catalog.legacy_capabilities(),
                "serverInfo": catalog.server_info,
                "instructions": catalog.instructions,
            }
        elif method == "ping":
            result = {}
        else:  # prompts/get
            result = catalog.get_prompt(params.get("name"), params.get("arguments"))
        return jsonrpc.encode_result(message.request_id, _shape(catalog, result, era))

    async def _tools_call(
        self,
        catalog: Catalog,
        message: Message,
        era: Era,
        headers: dict[str, str],
        receive: Receive,
        send: Send,
        body_size: int,
    ) -> str:
        spec = catalog.tool_spec(message.params.get("name"))
        arguments = message.params.get("arguments")
        if arguments is None:
            arguments = {}
        if era is Era.MODERN and isinstance(arguments, dict):
            check_param_headers(spec.header_params, arguments, headers)
        token = message.meta.get("progressToken")
        timeout = call_timeout_s(message.meta, self.settings.request_timeout_s)
        cache_key = arguments.get("cache_key") if isinstance(arguments, dict) else None
        if isinstance(token, bool) or not isinstance(token, str | int):
            token = None  # progress is streamed only to a caller that names a token
        if not http_io.accepts(headers.get("accept"), "text/event-stream"):
            token = None
        declared = era is Era.MODERN and declares_tasks(message.meta)
        as_task = self.tasks.wanted(spec.name, arguments, message.meta, declared)
        tenant = current_tenant()
        async with self.calls.admit(receive, headers, cache_key, timeout) as call:
            if as_task:
                await self.tasks.admit(tenant)  # the tenant's cap, before the engine is asked
            # Admitted (or refused: then the answer is still a plain 503) before anything is
            # sent, so an SSE response starts only once the backend has taken the call.
            items = await call.run(self.tools.start(spec, arguments, body_size))
            if as_task:  # the generation goes on without this connection
                task = await self.tasks.begin(spec.name, items, tenant)
                if task is not None:
                    result = create_task_result(task.view(), catalog.server_info)
                    body = jsonrpc.encode_result(message.request_id, result)
                    await http_io.send_response(send, 200, body)
                    return "task"
            if token is not None:
                shape = functools.partial(_shape, catalog, era=era)
                events = tool_call_events(message.request_id, token, items, shape)
                await call.watch(
                    self._stream(send, events, message.request_id, call.deadline, timeout)
                )
                return "ok"
            result = await call.run(_result(items))
        body = jsonrpc.encode_result(message.request_id, _shape(catalog, result, era))
        await http_io.send_response(send, 200, body)
        return "tool_error" if result.get("isError") else "ok"

    async def _listen(
        self, catalog: Catalog, message: Message, receive: Receive, send: Send
    ) -> str:
        check_listen_filter(message.params.get("notifications"), message.meta)
        honoured = accepted_filter(message.params.get("notifications"))
        events = listen_events(
            message.request_id,
            honoured,
            self.versions(),
            self.settings.keepalive_s,
            self.settings.listen_max_s,
            catalog.server_info,
        )
        # It ends itself after listen_max_s; the deadline only cuts off a reader that stalled.
        timeout = self.settings.listen_max_s + STREAM_CLOSE_GRACE_S
        deadline = asyncio.get_running_loop().time() + timeout
        stream = self._stream(send, events, message.request_id, deadline, timeout)
        await http_io.until_disconnect(receive, stream)
        return "ok"

    async def _stream(
        self,
        send: Send,
        events: AsyncGenerator[bytes],
        request_id: RequestId,
        deadline: float,
        timeout_s: float,
    ) -> None:
        """Send an SSE response until ``deadline`` (loop time, ``timeout_s`` after the call
        began); a failure or the deadline mid-stream still ends it with an error event."""
        error = await send_sse(send, events, request_id, deadline, timeout_s)
        if error is not None:
            self._count_rejection(_rejection_reason(error))

    async def _error(
        self,
        send: Send,
        wire: ProtocolError,
        error: CallError,
        era: Era,
        message: Message | None,
    ) -> None:
        """Answer a call error: its JSON-RPC error (no id for a transport refusal, which may
        come before the body was read) and HTTP status; ``Allow`` for a 405, ``Connection:
        close`` where the rest of the body may still come, a challenge's ``WWW-Authenticate``."""
        headers: list[tuple[bytes, bytes]] = []
        if isinstance(error, Rejected):
            message = None
            if error.status == 405:
                headers = ALLOW_POST
            elif error.status in (408, 413):
                headers = CLOSE
        elif isinstance(error, Challenge):
            headers = error.headers()
        if isinstance(error, Rejected | Challenge):
            self._count_rejection(error.reason)
        status = http_status(error, wire, era is Era.MODERN)
        await self._send_error(send, status, wire, message, headers)

    async def _send_error(
        self,
        send: Send,
        status: int,
        error: ProtocolError,
        message: Message | None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        if error.request_id is None and message is not None:
            error.request_id = message.id
        self._count_rejection(_rejection_reason(error))
        extra = list(headers or ())
        if isinstance(error.data, dict) and "retryAfterS" in error.data:
            extra.append((b"retry-after", str(error.data["retryAfterS"]).encode()))
        await http_io.send_response(send, status, jsonrpc.encode_error(error), headers=extra)

    def _count_rejection(self, reason: str | None) -> None:
        if reason is not None:
            self.metrics.count("kvgate_rejected_requests", reason=reason)


def _shape(catalog: Catalog, result: dict[str, Any], era: Era) -> dict[str, Any]:
    """Modern results say they are complete and who answered; legacy ones stay as they were."""
    return complete(result, catalog.server_info) if era is Era.MODERN else result


async def _result(items: Items) -> dict[str, Any]:
    """Drain a tool call, keeping only its result."""
    async with aclosing(items):
        async for item in items:
            if not isinstance(item, Progress):
                return item
    raise RuntimeError("tool call ended without a result")


def _rejection_reason(error: ProtocolError) -> str | None:
    """The limit that refused a request (for metrics), or None for an ordinary error."""
    if error.code in REFUSAL_CODES and isinstance(error.data, dict):
        return error.data.get("reason")
    return None


def _accepts_mcp(accept: str | None) -> bool:
    """No Accept means anything; otherwise one of the two MCP answer types must be welcome."""
    return accept is None or not http_io.accepted(accept).isdisjoint(ACCEPTABLE)


def _params_hash(method: str, params: dict[str, Any]) -> str:
    if method != "resources/read":
        return "-"
    return hashlib.sha256(str(params.get("uri")).encode()).hexdigest()[:16]
