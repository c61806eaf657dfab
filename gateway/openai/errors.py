"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the status."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.admission import Refusal

# HTTP status → the OpenAI error ``type`` clients (and the openai SDK) expect for it
TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "timeout_error",
}


class OpenAIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str | None = None,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.type = type_ or TYPES.get(status, "invalid_request_error")
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

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
        if self.retry_after_s is None:
            return []
        return [(b"retry-after", str(self.retry_after_s).encode())]


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def from_refusal(refusal: Refusal) -> OpenAIError:
    code = "rate_limit_exceeded" if refusal.status == 429 else "service_unavailable"
    return OpenAIError(refusal.status, str(refusal), code=code, retry_after_s=refusal.retry_after_s)


def deadline_exceeded(timeout_s: float) -> OpenAIError:
    return OpenAIError(
        504,
        f"Request timed out after {timeout_s:g} s; the generation was cancelled",
        code="timeout",
    )
