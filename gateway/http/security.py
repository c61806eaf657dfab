"""Origin and Host checks against DNS rebinding (Streamable HTTP "Security & Endpoint").

A browser page on a hostile site can resolve its own name to 127.0.0.1 and post to a local
server. Two checks stop it: a present ``Origin`` must be local or explicitly allowed, and a
server bound to loopback only answers requests whose ``Host`` names loopback (or an allowed
origin's host). A server bound to a public interface sits behind a load balancer whose host
names it cannot know, so there only the Origin check applies.
"""

from __future__ import annotations

from urllib.parse import urlsplit

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
