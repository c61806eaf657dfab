"""JSON-RPC and MCP error codes, and the one exception every protocol rule raises.

Each error knows its HTTP status so the transport never has to guess: the modern Streamable
HTTP binding fixes 400 for envelope, header and version failures and 404 for unknown methods.
"""

from __future__ import annotations

from typing import Any

from kvgate.protocol.jsonrpc_types import RequestId

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603
HEADER_MISMATCH = -32020
MISSING_REQUIRED_CLIENT_CAPABILITY = -32021
UNSUPPORTED_PROTOCOL_VERSION = -32022

# kvgate's own codes. The 2026-07-28 allocation policy (basic/index.mdx, "Error Codes"): new
# codes SHOULD be allocated outside the JSON-RPC reserved range -32768..-32000 (-32000..-32019
# is legacy, -32020..-32099 belongs to MCP), so these sit just above it.
SERVER_OVERLOADED = -31000  # the engine's queues (or listen streams) are full: retry later
RATE_LIMITED = -31001  # this client already has its allowed number of calls in flight
REQUEST_TIMEOUT = -31002  # the call's deadline passed; its generation was cancelled

MODERN_HTTP_STATUS = {
    PARSE_ERROR: 400,
    INVALID_REQUEST: 400,
    INVALID_PARAMS: 400,
    HEADER_MISMATCH: 400,
    MISSING_REQUIRED_CLIENT_CAPABILITY: 400,
    UNSUPPORTED_PROTOCOL_VERSION: 400,
    METHOD_NOT_FOUND: 404,
    SERVER_OVERLOADED: 503,
    RATE_LIMITED: 429,
    REQUEST_TIMEOUT: 504,
}
"""HTTP status per error code under modern (2026-07-28) rules; anything else is 200."""

LEGACY_HTTP_STATUS = {
    PARSE_ERROR: 400,
    INVALID_REQUEST: 400,
    HEADER_MISMATCH: 400,
    UNSUPPORTED_PROTOCOL_VERSION: 400,
    SERVER_OVERLOADED: 503,
    RATE_LIMITED: 429,
    REQUEST_TIMEOUT: 504,
}
"""Legacy wires answer handler errors with 200; unreadable or self-contradicting requests 400."""


class ProtocolError(Exception):
    """A JSON-RPC error response waiting to be sent: code, message, optional data and id."""

    def __init__(
        self,
        code: int,
        message: str,
        data: Any = None,
        request_id: RequestId | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data
        self.request_id = request_id

    def http_status(self, modern: bool) -> int:
        table = MODERN_HTTP_STATUS if modern else LEGACY_HTTP_STATUS
        return table.get(self.code, 200)

    def to_error(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


def refused(code: int, message: str, reason: str, retry_after_s: float) -> ProtocolError:
    """An overload or rate-limit refusal; ``data`` says why and when to come back (the HTTP
    transport mirrors ``retryAfterS`` into ``Retry-After``)."""
    seconds = max(1, round(retry_after_s))
    return ProtocolError(code, message, data={"reason": reason, "retryAfterS": seconds})


def header_mismatch(message: str) -> ProtocolError:
    return ProtocolError(HEADER_MISMATCH, f"Header mismatch: {message}")


def invalid_params(message: str, data: Any = None) -> ProtocolError:
    return ProtocolError(INVALID_PARAMS, message, data)
