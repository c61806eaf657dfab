"""The ASGI middleware that authenticates each HTTP request before any endpoint runs.

It serves the Protected Resource Metadata, answers a refused credential itself (its body
worded by the door the path belongs to: ``render``, composed by the app, so auth knows no
door), and otherwise leaves the identity in ``scope["state"]`` and ``identity.CURRENT`` for the
request. ``/mcp`` checks per-method scopes with ``authorize_call`` once it has parsed the
method; tenant budgets are taken where every call is admitted (``kvgate.gateway.calls.lifecycle``).
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from kvgate.gateway.auth.authenticator import Authenticator
from kvgate.gateway.auth.challenge import Challenge
from kvgate.gateway.auth.identity import CURRENT
from kvgate.gateway.http import io as http_io
from kvgate.gateway.ops.metrics import Metrics

STATE_IDENTITY = "identity"
STATE_AUTHENTICATOR = "authenticator"
# A challenge's body for a path (the challenge's status and WWW-Authenticate go as they are).
Render = Callable[[str, Challenge], bytes]


def plain(path: str, challenge: Challenge) -> bytes:
    """The body on routes that belong to no door: ``{"error": "…"}``."""
    return orjson.dumps({"error": str(challenge)})


class AuthMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        authenticator: Authenticator,
        metrics: Metrics,
        server_name: str,
        render: Render = plain,
    ) -> None:
        self.app = app
        self.auth = authenticator
        self.metrics = metrics  # refusals count in kvgate_rejected_requests_total{reason}
        self.server_name = server_name
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path in self.auth.metadata_paths and scope["method"] in ("GET", "HEAD"):
            body = orjson.dumps(self.auth.metadata(self.server_name))
            await http_io.send_response(send, 200, body)
            return
        authorization = [v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"]
        try:
            identity = await self.auth.authenticate(path, authorization)
        except Challenge as challenge:
            self.metrics.count("kvgate_rejected_requests", reason=challenge.reason)
            body = self.render(path, challenge)
            await http_io.send_response(send, challenge.status, body, headers=challenge.headers())
            return
        state = scope.setdefault("state", {})
        state[STATE_IDENTITY] = identity
        state[STATE_AUTHENTICATOR] = self.auth
        token = CURRENT.set(identity)
        try:
            await self.app(scope, receive, send)
        finally:
            CURRENT.reset(token)


def authorize_call(scope: Scope, method: str) -> None:
    """Raise Challenge (403 insufficient_scope) unless the caller may run MCP ``method``."""
    state = scope.get("state") or {}
    auth: Authenticator | None = state.get(STATE_AUTHENTICATOR)
    identity = state.get(STATE_IDENTITY)
    if auth is not None and identity is not None:
        auth.require(identity, auth.call_scopes(method))
