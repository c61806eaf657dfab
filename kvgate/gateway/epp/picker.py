"""The endpoint picker's decision: fleet mode's, asked without relaying the call.

``Picker.pick`` reads the body as a fleet gateway's door would (``bodies``) and asks
``Fleet.pick``, the same ``decide`` and ``Chooser.choose`` a relayed call goes through, for an
upstream. The answer is the upstream's ``host:port`` (what Envoy's ``ORIGINAL_DST`` cluster
connects to), or a refusal with an HTTP status and a reason: 503 when no member can take the
call (all down, or none in the proxy's subset hint), as the EPP protocol asks.

The pick holds a ``Lease`` on its upstream until the ext_proc stream ends (Envoy ends it once
the request has been processed), so the picker's own in-flight count weighs in ``Load`` as a
fleet gateway's calls do, between two scrapes of the upstreams' ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from urllib.parse import urlsplit

from kvgate.engine.errors import AdmissionRefused, EngineOverloaded
from kvgate.gateway.epp import bodies
from kvgate.gateway.upstream.fleet import Fleet
from kvgate.gateway.upstream.upstream import Lease, Upstream


@dataclass(frozen=True, slots=True)
class Refusal:
    """No endpoint: the HTTP status the proxy answers with, and why."""

    status: int
    reason: str


def endpoint(url: str) -> str:
    """An upstream's ``host:port``, as the proxy is told it (and as subset hints name it)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Picker:
    """Fleet mode's routing over a fleet's members, answered as endpoints."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._endpoints: dict[str, str] = {}  # url -> host:port, computed once per member

    def endpoint_of(self, upstream: Upstream) -> str:
        found = self._endpoints.get(upstream.url)
        if found is None:
            found = self._endpoints[upstream.url] = endpoint(upstream.url)
        return found

    async def pick(
        self, path: str, body: bytes, subset: Collection[str] | None = None
    ) -> Lease | Refusal:
        """The upstream for the call ``body`` to ``path`` (held by the returned lease until
        ``release``), within ``subset`` (host:port) when the proxy gives one."""
        excluded: set[int] = set()
        if subset is not None:
            members = self.fleet.upstreams
            excluded = {u.index for u in members if self.endpoint_of(u) not in subset}
            if len(excluded) == len(members):
                return Refusal(503, "no endpoint of the subset hint is a member")
        request = bodies.read(path, body, self.fleet.model_name)
        try:
            upstream = await self.fleet.pick(request, excluded)
        except AdmissionRefused as exc:  # EngineUnavailable: every member down or excluded
            return Refusal(429 if isinstance(exc, EngineOverloaded) else 503, str(exc))
        return Lease(upstream)
