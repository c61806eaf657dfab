"""The MCP endpoint (``POST /mcp``): the request pipeline of the Streamable HTTP binding.

In order: HTTP method → Origin/Host → body size → Content-Type → JSON-RPC parse →
notification (202) → era from ``MCP-Protocol-Version`` → modern envelope and header checks
(or legacy checks) → method table → handler. Catalog results are pre-serialized bytes spliced
around the request id; tool calls run on the engine, as JSON or as SSE when the caller sent a
``progressToken`` and accepts ``text/event-stream``.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.types import Receive, Scope, Send

from gateway import http_io
from gateway.catalog import Catalog
from gateway.discovery_cache import DiscoveryCache
from gateway.metrics import Metrics
from gateway.settings import Settings
from gateway.streaming import accepted_filter, listen_events, tool_call_events
from gateway.tools import InferenceTools, Progress
from gateway.transport_security import OriginPolicy
from protocol import jsonrpc
from protocol.errors import INVALID_REQUEST, ProtocolError, invalid_params
from protocol.headers import check_param_headers
from protocol.jsonrpc_types import Message
from protocol.methods import CATALOG_METHODS, MODERN_METHODS, check_method
from protocol.modern import check_legacy_meta, check_modern_request
from protocol.results import complete
from protocol.versions import Era, era_of, negotiate_legacy

ALLOW_POST = [(b"allow", b"POST")]
ACCEPTABLE = ("application/json", "text/event-stream", "*/*", "application/*")
LEGACY_LABELS = frozenset({"initialize", "ping"})


class McpEndpoint:
    """An ASGI app for the MCP endpoint path."""

    def __init__(
        self,
        settings: Settings,
        catalog: Catalog,
        tools: InferenceTools,
        cache: DiscoveryCache,
        metrics: Metrics,
    ) -> None:
        self.settings = settings
        self.catalog = catalog
        self.tools = tools
        self.cache = cache
        self.metrics = metrics
        self.origins = OriginPolicy(settings.host, settings.allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        # ASGI servers lower-case header names; RFC 9110 5.5: whitespace around a value is not data
        headers = {k.decode("latin-1"): v.decode("latin-1").strip(" \t") for k, v in scope["headers"]}
        label, tool, outcome = "invalid", None, "error"
        era = Era.LEGACY
        message: Message | None = None
        try:
            if scope["method"] != "POST":
                await self._plain(send, 405, "Method Not Allowed: the MCP endpoint takes POST only")
                return
            if not self.origins.origin_allowed(headers.get("origin")) or not self.origins.host_allowed(headers.get("host")):
                await self._error(send, 403, ProtocolError(INVALID_REQUEST, "Forbidden: Origin or Host not allowed"))
                return
            try:
                body = await http_io.read_body(receive, self.settings.max_body_bytes, headers.get("content-length"))
            except http_io.BodyTooLarge:
                limit = self.settings.max_body_bytes
                await self._error(send, 413, ProtocolError(INVALID_REQUEST, f"Request body exceeds {limit} bytes"))
                return
            if not headers.get("content-type", "").lower().startswith("application/json"):
                await self._error(send, 415, ProtocolError(INVALID_REQUEST, "Content-Type must be application/json"))
                return
            if not _accepts_mcp(headers.get("accept")):
                await self._error(send, 406, ProtocolError(
                    INVALID_REQUEST, "Not Acceptable: accept application/json and text/event-stream"))
                return
            message = jsonrpc.parse_message(body)
            if message.is_notification:
                label, outcome = "notification", "ok"
                await http_io.send_response(send, 202, content_type=None)
                return
            label = message.method if message.method in MODERN_METHODS | LEGACY_LABELS else "unknown"
            era = era_of(headers.get("mcp-protocol-version"))
            if era is Era.MODERN:
                check_modern_request(message, headers)
            else:
                check_legacy_meta(message, headers.get("mcp-protocol-version"))
            check_method(message.method, era)
            if message.method == "tools/call":
                tool = message.params.get("name") if isinstance(message.params.get("name"), str) else None
                outcome = await self._tools_call(message, era, headers, receive, send)
            elif message.method == "subscriptions/listen":
                outcome = await self._listen(message, receive, send)
            else:
                await http_io.send_response(send, 200, await self._result(message, era))
                outcome = "ok"
        except ProtocolError as error:
            if error.request_id is None and message is not None:
                error.request_id = message.id
            await self._error(send, error.http_status(era is Era.MODERN), error)
        except http_io.ClientGone:
            outcome = "cancelled"
        finally:
            if tool is not None and tool not in self.tools.specs:
                tool = "unknown"
            self.metrics.observe(label, tool, outcome, time.perf_counter() - started)

    async def _result(self, message: Message, era: Era) -> bytes:
        """The response bytes for every method answered in one piece (no engine work)."""
        method, params = message.method, message.params
        if method in CATALOG_METHODS or method == "server/discover":
            if "cursor" in params:
                raise invalid_params("Invalid cursor: this server returns every list in one page")
            body = await self.cache.get_or_build(
                self.catalog.version, method, _params_hash(method, params),
                lambda: self.catalog.result_bytes(method, params),
            )
            return jsonrpc.splice_result(message.id, body)
        if method == "initialize":
            result = {
                "protocolVersion": negotiate_legacy(params.get("protocolVersion")),
                "capabilities": self.catalog.legacy_capabilities(),
                "serverInfo": self.catalog.server_info,
                "instructions": self.settings.instructions,
            }
        elif method == "ping":
            result = {}
        else:  # prompts/get
            result = self.catalog.get_prompt(params.get("name"), params.get("arguments"))
        return jsonrpc.encode_result(message.id, self._shape(result, era))

    async def _tools_call(
        self, message: Message, era: Era, headers: dict[str, str], receive: Receive, send: Send
    ) -> str:
        spec = self.tools.spec(message.params.get("name"))
        arguments = message.params.get("arguments") or {}
        if era is Era.MODERN and isinstance(arguments, dict):
            check_param_headers(spec.header_params, arguments, headers)
        token = message.meta.get("progressToken")
        items = self.tools.call(spec, arguments)
        if isinstance(token, str | int) and "text/event-stream" in headers.get("accept", ""):
            events = tool_call_events(message.id, token, items, lambda r: self._shape(r, era))
            await http_io.until_disconnect(receive, self._stream(send, events))
            return "ok"
        result = await http_io.until_disconnect(receive, _last(items))
        await http_io.send_response(send, 200, jsonrpc.encode_result(message.id, self._shape(result, era)))
        return "tool_error" if result.get("isError") else "ok"

    def _shape(self, result: dict[str, Any], era: Era) -> dict[str, Any]:
        """Modern results say they are complete and who answered; legacy ones stay as they were."""
        return complete(result, self.catalog.server_info) if era is Era.MODERN else result

    async def _listen(self, message: Message, receive: Receive, send: Send) -> str:
        honoured = accepted_filter(message.params.get("notifications"))
        events = listen_events(
            message.id, honoured, self.cache.versions(), self.settings.keepalive_s,
            self.settings.listen_max_s, self.catalog.server_info,
        )
        await http_io.until_disconnect(receive, self._stream(send, events))
        return "ok"

    async def _stream(self, send: Send, events: AsyncIterator[bytes]) -> None:
        async with aclosing(events):
            await http_io.start_stream(send)
            async for chunk in events:
                await http_io.send_chunk(send, chunk)
            await http_io.send_chunk(send, b"", more=False)

    async def _error(self, send: Send, status: int, error: ProtocolError) -> None:
        await http_io.send_response(send, status, jsonrpc.encode_error(error))

    async def _plain(self, send: Send, status: int, text: str) -> None:
        await http_io.send_response(send, status, text.encode(), b"text/plain; charset=utf-8", ALLOW_POST)


async def _last(items: AsyncIterator[Progress | dict[str, Any]]) -> dict[str, Any]:
    """Drain a tool call, keeping only its result."""
    async with aclosing(items):
        async for item in items:
            if not isinstance(item, Progress):
                return item
    raise RuntimeError("tool call ended without a result")


def _accepts_mcp(accept: str | None) -> bool:
    """No Accept means anything; otherwise one of the two MCP answer types must be welcome."""
    if accept is None:
        return True
    accept = accept.lower()
    return any(kind in accept for kind in ACCEPTABLE)


def _params_hash(method: str, params: dict[str, Any]) -> str:
    if method != "resources/read":
        return "-"
    return hashlib.sha256(str(params.get("uri")).encode()).hexdigest()[:16]
