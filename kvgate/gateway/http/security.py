"""Origin and Host checks against DNS rebinding (Streamable HTTP "Security & Endpoint").

A browser page on a hostile site can resolve its own name to 127.0.0.1 and post to a local
server. Two checks stop it: a present ``Origin`` must be local or explicitly allowed, and a
server bound to loopback only answers requests whose ``Host`` names loopback (or an allowed
origin's host). A server bound to a public interface sits behind a load balancer whose host
names it cannot know, so there only the Origin check applies. ``HostOriginGuard`` applies the
rules to every route; the MCP and OpenAI endpoints apply them themselves (own error format).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from kvgate.gateway.http.io import send_response

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def _hostname(authority: str) -> str:
    """``"[::1]:8000"`` → ``"::1"``, ``"Localhost:80"`` → ``"localhost"``."""
    try:
        return (urlsplit(f"//{authority}").hostname or "").lower()
    except ValueError:
        return ""


class OriginPolicy:
    def __init__(self, bind_host: str, allowed_origins: tuple[str, ...] = ()) -> None:
        self._any_origin = "*" in allowed_origins
        self._origins = frozenset(o.rstrip("/").lower() for o in allowed_origins if o != "*")
        self._hosts = LOOPBACK_NAMES | {_hostname(urlsplit(o).netloc) for o in self._origins}
        self._check_host = bind_host.strip("[]").lower() in LOOPBACK_NAMES

    def origin_allowed(self, origin: str | None) -> bool:
        """No Origin (not a browser) is fine; a local or listed Origin is fine."""
        if origin is None or self._any_origin:
            return True
        normalized = origin.rstrip("/").lower()
        if normalized in self._origins:
            return True
        try:
            parts = urlsplit(normalized)
        except ValueError:
            return False
        return parts.scheme in ("http", "https") and (parts.hostname or "") in LOOPBACK_NAMES

    def host_allowed(self, host: str | None) -> bool:
        if not self._check_host:
            return True
        return host is not None and _hostname(host) in self._hosts


DECIDING_HEADERS = frozenset((b"host", b"origin"))


def repeated(
    raw_headers: Iterable[tuple[bytes, bytes]], names: Callable[[bytes], bool]
) -> str | None:
    """The first header name (lower-case, as ASGI gives it) that ``names`` selects and that
    occurs more than once: a proxy reads the first, a dict the last, so neither may decide."""
    seen: set[bytes] = set()
    for name, _ in raw_headers:
        if names(name):
            if name in seen:
                return name.decode("latin-1")
            seen.add(name)
    return None


class HostOriginGuard:
    """ASGI middleware applying the Origin/Host rules (and refusing a repeated ``Host`` or
    ``Origin``) to every HTTP route but ``self_guarded`` ones, which answer in their own
    error format (the MCP endpoint in JSON-RPC, the OpenAI routes in OpenAI's)."""

    def __init__(self, app: ASGIApp, policy: OriginPolicy, self_guarded: Iterable[str]) -> None:
        self.app = app
        self.policy = policy
        self.self_guarded = frozenset(self_guarded)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.self_guarded:
            await self.app(scope, receive, send)
            return
        refused = refusal(self.policy, scope["headers"])
        if refused is None:
            await self.app(scope, receive, send)
            return
        status, message = refused
        await send_response(send, status, orjson.dumps({"error": message}))


def refusal(
    policy: OriginPolicy, raw_headers: Iterable[tuple[bytes, bytes]]
) -> tuple[int, str] | None:
    """(status, reason) when a request's Origin/Host must be refused (a repeated one too),
    else None: what every route applies, each front door in its own error format."""
    duplicate = repeated(raw_headers, DECIDING_HEADERS.__contains__)
    if duplicate is not None:
        return 400, f"Bad Request: more than one {duplicate} header"
    values = {k: v.decode("latin-1").strip(" \t") for k, v in raw_headers if k in DECIDING_HEADERS}
    if policy.origin_allowed(values.get(b"origin")) and policy.host_allowed(values.get(b"host")):
        return None
    return 403, "Forbidden: Origin or Host not allowed"
