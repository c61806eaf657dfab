"""Authentication failures as RFC 6750 / RFC 9728 challenges, worded per front door.

``401`` carries ``WWW-Authenticate: Bearer resource_metadata="…", scope="…"`` (no error code
when no credentials came, ``error="invalid_token"`` when they did not verify); ``403``
carries ``error="insufficient_scope"`` with every scope the operation needs; ``400``
``error="invalid_request"`` is a malformed ``Authorization`` header. The body is a JSON-RPC
error on ``/mcp``, an OpenAI error on the OpenAI routes, ``{"error": "…"}`` elsewhere.
"""

from __future__ import annotations

import orjson

from gateway.openai.errors import OpenAIError
from protocol import jsonrpc
from protocol.errors import ProtocolError

AUTH_ERROR_CODE = -31010  # kvgate's JSON-RPC code for a refused credential (outside -32768..-32000)
OPENAI_PATHS = ("/v1/", "/tokenize", "/detokenize")
OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error"}


class Challenge(Exception):
    def __init__(
        self,
        status: int,
        error: str | None,
        description: str,
        scope: tuple[str, ...] = (),
        resource_metadata: str | None = None,
    ) -> None:
        super().__init__(description)
        self.status = status
        self.error = error  # None | invalid_request | invalid_token | insufficient_scope
        self.scope = scope
        self.resource_metadata = resource_metadata

    @property
    def reason(self) -> str:
        return self.error or "unauthenticated"

    def www_authenticate(self) -> str:
        """In the order the MCP authorization spec's examples use."""
        params: list[tuple[str, str]] = []
        if self.error is None:
            if self.resource_metadata:
                params.append(("resource_metadata", self.resource_metadata))
            if self.scope:
                params.append(("scope", " ".join(self.scope)))
        else:
            params.append(("error", self.error))
            if self.scope:
                params.append(("scope", " ".join(self.scope)))
            if self.resource_metadata:
                params.append(("resource_metadata", self.resource_metadata))
            params.append(("error_description", _quotable(str(self))))
        if not params:
            return "Bearer"
        return "Bearer " + ", ".join(f'{name}="{value}"' for name, value in params)

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"www-authenticate", self.www_authenticate().encode("latin-1", "replace"))]

    def body(self, path: str, request_id: object = None) -> bytes:
        if path == "/mcp":
            data = {"reason": self.reason}
            error = ProtocolError(AUTH_ERROR_CODE, str(self), data, request_id)  # type: ignore[arg-type]
            return jsonrpc.encode_error(error)
        if path.startswith(OPENAI_PATHS):
            type_ = OPENAI_TYPES.get(self.status, "invalid_request_error")
            return OpenAIError(self.status, str(self), type_, code=self.reason).encode()
        return orjson.dumps({"error": str(self)})


def _quotable(text: str) -> str:
    """A quoted-string value: no quotes, backslashes or control characters."""
    return "".join(c for c in text if c not in '"\\' and 32 <= ord(c) < 127)
