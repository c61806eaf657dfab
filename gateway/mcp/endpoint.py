"""The MCP endpoint (``POST /mcp``): the request pipeline of the Streamable HTTP binding.

In order: HTTP method → Origin/Host → body size → Content-Type → Accept → JSON-RPC parse →
notification (202) → era from ``MCP-Protocol-Version`` → modern envelope and header checks
(or legacy checks) → method table → handler. Catalog results are pre-serialized bytes spliced
around the request id; tool calls run on the engine, as JSON or as SSE when the caller sent a
``progressToken`` and accepts ``text/event-stream``.

Limits (``gateway.admission``, ``gateway.mcp.deadline``): a body must arrive within ``body_timeout_s`` and nest no
deeper than ``max_json_depth``; a tools/call runs under its client's concurrency limit, is
refused (503) when the engine is at capacity — its SSE response starts only once the engine
has admitted it — and is cancelled at its deadline; listen streams are capped. Each SSE response is its own task whose sends wait on that client only,
so a reader that stops reading stalls nothing else (and its deadline still ends it).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from starlette.types import Receive, Scope, Send

from engine import AdmissionRefused
from gateway.admission import (
    ConcurrencyLimit,
    Refusal,
    client_key,
    client_limited,
    engine_refused,
    listen_limited,
)
from gateway.auth.challenge import Challenge
from gateway.auth.middleware import authorize_call
from gateway.catalog.catalog import Catalog, CatalogHolder
from gateway.catalog.discovery_cache import DiscoveryCache
from gateway.http import io as http_io
from gateway.http.security import DECIDING_HEADERS, OriginPolicy, repeated
from gateway.mcp.deadline import call_timeout_s, deadline_exceeded
from gateway.mcp.streaming import (
    STREAM_CLOSE_GRACE_S,
    accepted_filter,
    listen_events,
    send_sse,
    tool_call_events,
)
from gateway.mcp.tool_runner import Progress, ToolRunner
from gateway.ops import tracing
from gateway.ops.metrics import Metrics
from gateway.settings import Settings
from protocol import jsonrpc
from protocol.errors import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    RATE_LIMITED,
    REQUEST_TIMEOUT,
    SERVER_OVERLOADED,
    ProtocolError,
    header_mismatch,
    invalid_params,
    refused,
)
from protocol.headers import check_param_headers, is_routing_header
from protocol.jsonrpc_types import Message, RequestId
from protocol.methods import CATALOG_METHODS, LEGACY_METHODS, MODERN_METHODS, check_method
from protocol.modern import check_legacy_meta, check_modern_request
from protocol.results import complete
from protocol.versions import Era, era_of, negotiate_legacy

logger = logging.getLogger("kvgate.mcp")

ALLOW_POST = [(b"allow", b"POST")]
CLOSE = [(b"connection", b"close")]
MCP_PATH = "/mcp"
LISTEN_KEY = "listen"  # every listen stream counts against one server-wide cap  # to send a stream's last event to a reader that may have stalled
ACCEPTABLE = ("application/json", "text/event-stream", "*/*", "application/*", "text/*")
REFUSAL_CODES = frozenset((SERVER_OVERLOADED, RATE_LIMITED, REQUEST_TIMEOUT))
METHOD_LABELS = MODERN_METHODS | LEGACY_METHODS  # anything else is counted as "unknown"
MRTR_RETRY_PARAMS = frozenset(("inputResponses", "requestState"))  # caching.mdx: MUST NOT cache


class Rejected(Exception):
    """A transport-level refusal: an HTTP status and a JSON-RPC error without an id."""

    def __init__(self, status: int, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason  # counted in kvgate_rejected_requests_total when set


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
        clients: ConcurrencyLimit | None = None,
    ) -> None:
        """``served`` holds the catalog being served (the reloader swaps it); ``versions``
        yields each catalog version this process starts serving (what listen streams follow);
        ``clients`` is the per-client concurrency limit (shared with the other front doors)."""
        self.settings = settings
        self.served = served
        self.tools = tools
        self.cache = cache
        self.metrics = metrics
        self.versions = versions
        self.origins = OriginPolicy(settings.host, settings.allowed_origins)
        # "is None", not "or": an empty ConcurrencyLimit is falsy (len 0) and would not be shared
        self.clients = (
            clients
            if clients is not None
            else ConcurrencyLimit(settings.max_concurrency_per_client)
        )
        self.listens = ConcurrencyLimit(settings.max_listen_streams)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
            await authorize_call(scope, message.method, message.params.get("name"))
            with tracing.request_span(message.method, message.params, message.meta, message.id):
                if message.method == "tools/call":
                    name = message.params.get("name")
                    tool = name if name in catalog.tool_specs else "unknown"
                    outcome = await self._tools_call(
                        catalog, message, era, headers, receive, send, len(body)
                    )
                elif message.method == "subscriptions/listen":
                    if self.listens.full(LISTEN_KEY):
                        raise listen_limited(self.settings.max_listen_streams)
                    with self.listens.hold(LISTEN_KEY):
                        outcome = await self._listen(catalog, message, receive, send)
                else:
                    body = await self._result(catalog, message, era)
                    await http_io.send_response(send, 200, body)
                    outcome = "ok"
        except Rejected as rejection:
            self._count_rejection(rejection.reason)
            error = jsonrpc.encode_error(ProtocolError(INVALID_REQUEST, str(rejection)))
            extra = ALLOW_POST if rejection.status == 405 else ()
            if rejection.status in (408, 413):  # the rest of the body may still come: hang up
                extra = CLOSE
            await http_io.send_response(send, rejection.status, error, headers=extra)
        except Challenge as challenge:  # a credential without the scope this method needs
            self._count_rejection(challenge.reason)
            body = challenge.body(MCP_PATH, message and message.id)
            await http_io.send_response(send, challenge.status, body, headers=challenge.headers())
        except (AdmissionRefused, Refusal) as exc:
            outcome = "rejected"
            error = _refusal_error(
                engine_refused(exc) if isinstance(exc, AdmissionRefused) else exc
            )
            error.request_id = message and message.id
            await self._error(send, error.http_status(era is Era.MODERN), error)
        except ProtocolError as error:
            if error.request_id is None and message is not None:
                error.request_id = message.id
            if _rejection_reason(error):
                outcome = "rejected"
            await self._error(send, error.http_status(era is Era.MODERN), error)
        except http_io.ClientGone:
            outcome = "cancelled"
        except Exception:
            logger.exception("internal error answering %s", label)
            error = ProtocolError(
                INTERNAL_ERROR, "Internal error", request_id=message and message.id
            )
            await self._error(send, 500, error)
        finally:
            self.metrics.observe(label, tool, outcome, time.perf_counter() - started)

    async def _transport_checks(
        self, scope: Scope, receive: Receive, headers: dict[str, str]
    ) -> bytes:
        """HTTP-level rules, in the spec's order; returns the body."""
        if scope["method"] != "POST":
            raise Rejected(405, "Method Not Allowed: the MCP endpoint takes POST only")
        duplicate = repeated(scope["headers"], DECIDING_HEADERS.__contains__)
        if duplicate is not None:
            raise Rejected(400, f"Bad Request: more than one {duplicate} header")
        duplicate = repeated(scope["headers"], lambda name: is_routing_header(name.decode()))
        if duplicate is not None:
            raise header_mismatch(f"more than one {duplicate} header")
        if not (
            self.origins.origin_allowed(headers.get("origin"))
            and self.origins.host_allowed(headers.get("host"))
        ):
            raise Rejected(403, "Forbidden: Origin or Host not allowed")
        limit, timeout = self.settings.max_body_bytes, self.settings.body_timeout_s
        try:
            body = await http_io.read_bounded(receive, headers, limit, timeout)
        except http_io.BodyTooLarge:
            raise Rejected(413, f"Request body exceeds {limit} bytes", "body_too_large") from None
        except TimeoutError:
            raise Rejected(
                408, f"Request body not received within {timeout:g} s", "body_timeout"
            ) from None
        if http_io.media_type(headers.get("content-type")) != "application/json":
            raise Rejected(415, "Unsupported Media Type: Content-Type must be application/json")
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
            return jsonrpc.splice_result(message.id, body)
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
        return jsonrpc.encode_result(message.id, _shape(catalog, result, era))

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
        client = client_key(headers.get("authorization"), cache_key)
        if self.clients.full(client):
            raise client_limited(self.settings.max_concurrency_per_client)
        streaming = isinstance(token, str | int) and not isinstance(token, bool)
        streaming = streaming and http_io.accepts(headers.get("accept"), "text/event-stream")
        deadline = asyncio.get_running_loop().time() + timeout
        with self.clients.hold(client):
            try:
                # Admitted (or refused: then the answer is still a plain 503) before anything
                # is sent, so an SSE response starts only once the engine has taken the call.
                start = http_io.before(deadline, self.tools.start(spec, arguments, body_size))
                items = await http_io.until_disconnect(receive, start)
                if streaming:
                    shape = functools.partial(_shape, catalog, era=era)
                    events = tool_call_events(message.id, token, items, shape)
                    stream = self._stream(send, events, message.id, deadline, timeout)
                    await http_io.until_disconnect(receive, stream)
                    return "ok"
                result = await http_io.until_disconnect(
                    receive, http_io.before(deadline, _result(items))
                )
            except TimeoutError:
                raise deadline_exceeded(timeout) from None
        body = jsonrpc.encode_result(message.id, _shape(catalog, result, era))
        await http_io.send_response(send, 200, body)
        return "tool_error" if result.get("isError") else "ok"

    async def _listen(
        self, catalog: Catalog, message: Message, receive: Receive, send: Send
    ) -> str:
        honoured = accepted_filter(message.params.get("notifications"))
        events = listen_events(
            message.id,
            honoured,
            self.versions(),
            self.settings.keepalive_s,
            self.settings.listen_max_s,
            catalog.server_info,
        )
        # It ends itself after listen_max_s; the deadline only cuts off a reader that stalled.
        timeout = self.settings.listen_max_s + STREAM_CLOSE_GRACE_S
        deadline = asyncio.get_running_loop().time() + timeout
        stream = self._stream(send, events, message.id, deadline, timeout)
        await http_io.until_disconnect(receive, stream)
        return "ok"

    async def _stream(
        self,
        send: Send,
        events: AsyncIterator[bytes],
        request_id: RequestId,
        deadline: float,
        timeout_s: float,
    ) -> None:
        """Send an SSE response until ``deadline`` (loop time, ``timeout_s`` after the call
        began); a failure or the deadline mid-stream still ends it with an error event."""
        error = await send_sse(send, events, request_id, deadline, timeout_s)
        if error is not None:
            self._count_rejection(_rejection_reason(error))

    async def _error(self, send: Send, status: int, error: ProtocolError) -> None:
        reason = _rejection_reason(error)
        self._count_rejection(reason)
        headers = ()
        if isinstance(error.data, dict) and "retryAfterS" in error.data:
            headers = ((b"retry-after", str(error.data["retryAfterS"]).encode()),)
        await http_io.send_response(send, status, jsonrpc.encode_error(error), headers=headers)

    def _count_rejection(self, reason: str | None) -> None:
        if reason is not None:
            self.metrics.count("kvgate_rejected_requests", reason=reason)


def _shape(catalog: Catalog, result: dict[str, Any], era: Era) -> dict[str, Any]:
    """Modern results say they are complete and who answered; legacy ones stay as they were."""
    return complete(result, catalog.server_info) if era is Era.MODERN else result


async def _result(items: AsyncIterator[Progress | dict[str, Any]]) -> dict[str, Any]:
    """Drain a tool call, keeping only its result."""
    async with aclosing(items):
        async for item in items:
            if not isinstance(item, Progress):
                return item
    raise RuntimeError("tool call ended without a result")


def _refusal_error(refusal: Refusal) -> ProtocolError:
    code = RATE_LIMITED if refusal.status == 429 else SERVER_OVERLOADED
    return refused(code, str(refusal), refusal.reason, refusal.retry_after_s)


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
