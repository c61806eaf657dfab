"""Authentication failures as RFC 6750 / RFC 9728 challenges.

``401`` carries ``WWW-Authenticate: Bearer resource_metadata="…", scope="…"`` (no error code
when no credentials came, ``error="invalid_token"`` when they did not verify); ``403``
carries ``error="insufficient_scope"`` with every scope the operation needs; ``400``
``error="invalid_request"`` is a malformed ``Authorization`` header. A ``Challenge`` is a call
error: the door a path belongs to words its body (a JSON-RPC error on ``/mcp``, an OpenAI
error on the OpenAI routes); the header is the same everywhere.
"""

from __future__ import annotations

from kvgate.gateway.calls.errors import CallError


class Challenge(CallError):
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
        self.reason: str = error or "unauthenticated"

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


def _quotable(text: str) -> str:
    """A quoted-string value: no quotes, backslashes or control characters."""
    return "".join(c for c in text if c not in '"\\' and 32 <= ord(c) < 127)
