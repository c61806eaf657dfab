"""The ASGI middleware that authenticates each HTTP request before any endpoint runs.

It answers refusals itself (a challenge, shaped for the path's front door), serves the
Protected Resource Metadata, and otherwise leaves the identity in ``scope["state"]`` and
``identity.CURRENT`` for the request. ``/mcp`` checks per-method scopes with
``authorize_call`` once it has parsed the method.
"""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.auth.authenticator import Authenticator
from gateway.auth.challenge import Challenge
from gateway.auth.identity import CURRENT
from gateway.http import io as http_io

STATE_IDENTITY = "identity"
STATE_AUTHENTICATOR = "authenticator"


class AuthMiddleware:
    def __init__(self, app: ASGIApp, authenticator: Authenticator, server_name: str) -> None:
        self.app = app
        self.auth = authenticator
        self.server_name = server_name

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path in self.auth.metadata_paths and scope["method"] in ("GET", "HEAD"):
            body = orjson.dumps(self.auth.metadata(self.server_name))
            await http_io.send_response(send, 200, body)
            return
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
                break
        try:
            identity = await self.auth.authenticate(path, authorization)
        except Challenge as challenge:
            await http_io.send_response(
                send, challenge.status, challenge.body(path), headers=challenge.headers()
            )
            return
        state = scope.setdefault("state", {})
        state[STATE_IDENTITY] = identity
        state[STATE_AUTHENTICATOR] = self.auth
        token = CURRENT.set(identity)
        try:
            await self.app(scope, receive, send)
        finally:
            CURRENT.reset(token)


def authorize_call(scope: Scope, method: str, tool: object) -> None:
    """Raise Challenge (403 insufficient_scope) unless the caller may run ``method``/``tool``."""
    state = scope.get("state") or {}
    auth: Authenticator | None = state.get(STATE_AUTHENTICATOR)
    if auth is not None:
        auth.require(state.get(STATE_IDENTITY), auth.call_scopes(method, tool))
