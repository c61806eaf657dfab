"""The ASGI middleware that authenticates each HTTP request before any endpoint runs.

It answers refusals itself (a challenge, shaped for the path's front door; a spent tenant
budget on the OpenAI routes), serves the Protected Resource Metadata, and otherwise leaves
the identity in ``scope["state"]`` and ``identity.CURRENT`` (and the budgets in
``budgets.CURRENT``) for the request. ``/mcp`` checks per-method scopes and budgets with
``authorize_call`` once it has parsed the method.
"""

from __future__ import annotations

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admission import Refusal
from gateway.auth import budgets as budgets_module
from gateway.auth.authenticator import INFERENCE_PATHS, Authenticator
from gateway.auth.budgets import Budgets
from gateway.auth.challenge import Challenge
from gateway.auth.identity import CURRENT
from gateway.http import io as http_io
from gateway.openai.errors import from_refusal
from gateway.ops.metrics import Metrics

STATE_IDENTITY = "identity"
STATE_AUTHENTICATOR = "authenticator"
STATE_BUDGETS = "budgets"


class AuthMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        authenticator: Authenticator,
        budgets: Budgets,
        metrics: Metrics,
        server_name: str,
    ) -> None:
        self.app = app
        self.auth = authenticator
        self.budgets = budgets
        self.metrics = metrics  # refusals count in kvgate_rejected_requests_total{reason}
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
        authorization = [v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"]
        try:
            identity = await self.auth.authenticate(path, authorization)
            if identity is not None and path in INFERENCE_PATHS and self.budgets:
                await self.budgets.admit(identity.tenant)
        except Challenge as challenge:
            self.metrics.count("kvgate_rejected_requests", reason=challenge.reason)
            await http_io.send_response(
                send, challenge.status, challenge.body(path), headers=challenge.headers()
            )
            return
        except Refusal as refusal:  # the tenant's budget is spent (OpenAI routes)
            self.metrics.count("kvgate_rejected_requests", reason=refusal.reason)
            error = from_refusal(refusal)
            await http_io.send_response(send, 429, error.encode(), headers=error.headers())
            return
        state = scope.setdefault("state", {})
        state[STATE_IDENTITY] = identity
        state[STATE_AUTHENTICATOR] = self.auth
        state[STATE_BUDGETS] = self.budgets
        token = CURRENT.set(identity)
        budgets_token = budgets_module.CURRENT.set(self.budgets)
        try:
            await self.app(scope, receive, send)
        finally:
            budgets_module.CURRENT.reset(budgets_token)
            CURRENT.reset(token)


async def authorize_call(scope: Scope, method: str, tool: object) -> None:
    """Raise Challenge (403 insufficient_scope) unless the caller may run ``method``/``tool``,
    or Refusal (429) when a tools/call finds its tenant's budget spent."""
    state = scope.get("state") or {}
    auth: Authenticator | None = state.get(STATE_AUTHENTICATOR)
    identity = state.get(STATE_IDENTITY)
    if auth is None or identity is None:
        return
    auth.require(identity, auth.call_scopes(method, tool))
    budgets: Budgets | None = state.get(STATE_BUDGETS)
    if method == "tools/call" and budgets:
        await budgets.admit(identity.tenant)
