"""The call errors (``kvgate.gateway.calls.errors``) in MCP's words, in one place.

A failure a tool call's caller can act on — bad arguments, a generation that broke — is a
tool error (``isError: true``, HTTP 200), as the spec asks of tool execution errors; the
rest are JSON-RPC errors: −31000 capacity (503 + ``Retry-After``), −31001 this client's or
tenant's limit (429 + ``Retry-After``), −31002 deadline (504), −31010 a refused credential
(its 400/401/403 and ``WWW-Authenticate``), −32602 bad params; a transport refusal keeps its
HTTP status with a −32600 error and no id.
"""

from __future__ import annotations

from typing import Any

from kvgate.gateway.auth.challenge import Challenge
from kvgate.gateway.calls.errors import (
    BadInput,
    CallError,
    DeadlineExceeded,
    GenerationFailed,
    Refused,
    Rejected,
)
from kvgate.protocol.errors import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    RATE_LIMITED,
    REQUEST_TIMEOUT,
    SERVER_OVERLOADED,
    ProtocolError,
    invalid_params,
    refused,
)

AUTH_ERROR_CODE = -31010  # a refused credential (outside -32768..-32000, as the spec asks)


def protocol_error(error: CallError) -> ProtocolError:
    """The JSON-RPC error for ``error`` (the caller sets its request id)."""
    if isinstance(error, Refused):
        code = RATE_LIMITED if error.status == 429 else SERVER_OVERLOADED
        return refused(code, str(error), error.reason or "refused", error.retry_after_s)
    if isinstance(error, DeadlineExceeded):
        data = {"reason": "deadline", "timeoutS": error.timeout_s}
        return ProtocolError(REQUEST_TIMEOUT, str(error), data)
    if isinstance(error, Challenge):
        return ProtocolError(AUTH_ERROR_CODE, str(error), {"reason": error.reason})
    if isinstance(error, BadInput):
        return invalid_params(str(error))
    if isinstance(error, Rejected):
        return ProtocolError(INVALID_REQUEST, str(error))
    if isinstance(error, GenerationFailed):
        return ProtocolError(INTERNAL_ERROR, f"Generation failed: {error}")
    return ProtocolError(INTERNAL_ERROR, "Internal error")


def http_status(error: CallError, wire: ProtocolError, modern: bool) -> int:
    """Transport refusals and challenges keep their own status; the rest follow the code."""
    if isinstance(error, Rejected | Challenge):
        return error.status
    return wire.http_status(modern)


def tool_error(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": True}


def failed_call(tool: str, error: BadInput | GenerationFailed) -> dict[str, Any]:
    """The tool error of a call whose arguments were bad or whose generation broke."""
    if isinstance(error, BadInput):
        return tool_error(f"Invalid arguments for tool '{tool}': {error}")
    return tool_error(f"Generation failed: {error}; retry the call")
