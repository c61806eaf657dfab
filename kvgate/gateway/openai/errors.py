"""The call errors (``kvgate.gateway.calls.errors``) in OpenAI's words, in one place:
``{"error": {"message", "type", "param", "code"}}`` with the status clients expect.

``OpenAIError`` is the wire form, and also the error for what only this door has (an unknown
model or route, a route a fleet cannot serve); ``wire`` maps every other call error to it.
"""

from __future__ import annotations

from typing import Any

import orjson

from kvgate.gateway.auth.challenge import Challenge
from kvgate.gateway.calls.errors import (
    BadInput,
    CallError,
    DeadlineExceeded,
    GenerationFailed,
    NotFound,
    Refused,
    Rejected,
    UpstreamFailed,
)

# HTTP status → the OpenAI error ``type`` clients (and the openai SDK) expect for it
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    501: "server_error",
    502: "server_error",
    503: "server_error",
    504: "timeout_error",
}
REJECTED_CODES = {400: "forbidden", 403: "forbidden", 413: "too_large"}  # Origin/Host; size


class OpenAIError(CallError):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
        allow: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_ or TYPES.get(status, "invalid_request_error")
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        self.allow = allow  # a 405's ``Allow`` header

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": str(self),
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def encode(self) -> bytes:
        return orjson.dumps(self.body())

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers = [] if self.allow is None else [(b"allow", self.allow.encode())]
        if self.retry_after_s is not None:
            headers.append((b"retry-after", str(self.retry_after_s).encode()))
        return headers


def wire(error: CallError) -> OpenAIError:
    """What the client is told for ``error``."""
    message = str(error)
    if isinstance(error, OpenAIError):
        return error
    if isinstance(error, NotFound):
        code = "model_not_found" if error.field == "model" else "not_found"
        return OpenAIError(404, message, param=error.field, code=code)
    if isinstance(error, BadInput):
        return OpenAIError(400, message, param=error.field)
    if isinstance(error, Rejected):
        return OpenAIError(error.status, message, code=REJECTED_CODES.get(error.status))
    if isinstance(error, Refused):
        code = "rate_limit_exceeded" if error.status == 429 else "service_unavailable"
        return OpenAIError(error.status, message, code=code, retry_after_s=error.retry_after_s)
    if isinstance(error, DeadlineExceeded):
        return OpenAIError(504, message, code="timeout")
    if isinstance(error, UpstreamFailed):
        return OpenAIError(502, f"Upstream failed: {message}", code="bad_gateway")
    if isinstance(error, GenerationFailed):
        return OpenAIError(500, f"Generation failed: {message}", code="generation_failed")
    if isinstance(error, Challenge):
        return OpenAIError(error.status, message, code=error.reason)
    return OpenAIError(500, "Internal error")
