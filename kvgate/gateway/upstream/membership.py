"""The fleet's members and their health: which upstreams are on the ring, which are routable,
and what each last reported of its load.

Members: the ``--upstream`` URLs and the addresses of the ``--upstream-dns`` names, re-resolved
every ``--upstream-refresh`` seconds (``members``). A new address joins the ring once its
``/v1/models`` names the fleet's model; one gone from the answer leaves it at once, its
clients closed when its last call ends. Each upstream keeps the index it was first given
(``replica`` in results, the ``upstream`` metric label).

Health: every failure a call, a proxied request or a check meets goes through ``failed``
(the breaker, when the kind ``breaks``, and ``kvgate_upstream_errors``); every
``--upstream-health-interval`` seconds each member's health path is checked. Load: every
``--upstream-scrape-interval`` seconds each member's ``/metrics`` is read for its queue,
batch and KV usage (``scrape``), which routing weighs with this gateway's own in-flight calls.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict
from typing import Any

from kvgate.gateway.settings import Settings
from kvgate.gateway.upstream import bounded, scrape
from kvgate.gateway.upstream.failures import TRANSPORT_ERRORS, AttemptFailed, Failure
from kvgate.gateway.upstream.fleet_metrics import FleetMetrics
from kvgate.gateway.upstream.health import Breaker
from kvgate.gateway.upstream.members import DnsTarget, Resolver
from kvgate.gateway.upstream.routing import UpstreamRouter
from kvgate.gateway.upstream.upstream import Upstream, headers

logger = logging.getLogger("kvgate.fleet")
# What asking an address which model it serves may fail with: the transport, or an answer
# that is not a /v1/models one.
PROBE_ERRORS = (*TRANSPORT_ERRORS, ValueError, KeyError, IndexError, TypeError)


class Membership:
    """The upstreams on the ring (``upstreams``, by index), those draining, and the ring."""

    def __init__(
        self,
        settings: Settings,
        model_name: str,
        urls: list[str],
        observed: FleetMetrics,
        resolve: Resolver,
        resolved: dict[DnsTarget, list[str]],
    ) -> None:
        self.settings = settings
        self.model_name = model_name
        self.observed = observed
        self._resolve = resolve
        self.targets = [DnsTarget.parse(spec) for spec in settings.upstream_dns]
        self._resolved = dict(resolved)
        # The listed members: ``--upstream``, or what ``kvgate epp`` reads from its endpoints
        # file (it sets them, then calls ``refresh``).
        self.listed: tuple[str, ...] = settings.upstream
        self._indices: dict[str, int] = {}
        self.upstreams: list[Upstream] = []
        self._draining: list[Upstream] = []
        self._set_members(urls)

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        states = [
            {
                "index": u.index,
                "url": u.url,
                "state": u.breaker.state,
                "in_flight": u.in_flight,
                "last_error": u.breaker.last_error,
                "scraped": None if u.scraped is None else asdict(u.scraped),
            }
            for u in self.upstreams
        ]
        return any(u.breaker.available() for u in self.upstreams), {"upstreams": states}

    def start_down(self, urls: frozenset[str]) -> None:
        """Those of ``urls`` did not answer at startup: out until a check passes."""
        for upstream in self.upstreams:
            if upstream.url in urls:
                for _ in range(self.settings.upstream_unhealthy_after):
                    upstream.breaker.failure(Failure.CONNECT)

    async def aclose(self) -> None:
        await asyncio.gather(*(u.aclose() for u in [*self.upstreams, *self._draining]))

    # -- health ------------------------------------------------------------------------------

    def failed(self, upstream: Upstream, failure: AttemptFailed) -> None:
        if failure.breaks:
            was = upstream.breaker.healthy
            upstream.breaker.failure(failure.kind)
            if was and not upstream.breaker.healthy:
                logger.warning("upstream %s is out: %s", upstream.url, failure)
        self.observed.count(
            "kvgate_upstream_errors", upstream=str(upstream.index), kind=failure.kind
        )

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(u) for u in self.upstreams))

    async def _check(self, upstream: Upstream) -> None:
        settings = self.settings
        try:
            await upstream.check(settings.upstream_health_path, settings.upstream_health_timeout_s)
        except AttemptFailed as failure:
            self.failed(upstream, failure)
            return
        was = upstream.breaker.healthy
        upstream.breaker.success()
        if not was and upstream.breaker.healthy:
            logger.info("upstream %s is back", upstream.url)

    # -- scraped load ------------------------------------------------------------------------

    async def scrape_all(self) -> None:
        await asyncio.gather(*(self._scrape(u) for u in self.upstreams))

    async def _scrape(self, upstream: Upstream) -> None:
        """Its ``/metrics`` load figures; a failed or invalid scrape leaves it with none (so
        it is routed on this gateway's in-flight count alone) and is counted."""
        label = str(upstream.index)
        try:
            text = await upstream.get_text(
                "/metrics", self.settings.upstream_health_timeout_s, bounded.MAX_METRICS_BYTES
            )
            scraped, invalid = scrape.parse(text)
        except AttemptFailed:
            upstream.observe(None)
            self.observed.count("kvgate_upstream_scrape_errors", upstream=label, kind="http")
            return
        except scrape.ScrapeError as exc:
            upstream.observe(None)
            logger.warning("upstream %s: /metrics: %s", upstream.url, exc)
            self.observed.count("kvgate_upstream_scrape_errors", upstream=label, kind="parse")
            return
        if invalid:
            self.observed.count("kvgate_upstream_scrape_errors", upstream=label, kind="invalid")
        upstream.observe(scraped)

    # -- members -----------------------------------------------------------------------------

    def _set_members(self, urls: list[str]) -> None:
        """The ring's members become ``urls``: new ones get the next index (or the one they
        had before), departed ones drain."""
        known = {u.url: u for u in self.upstreams}
        members = []
        for url in urls:
            upstream = known.pop(url, None)
            if upstream is None:
                index = self._indices.setdefault(url, len(self._indices))
                upstream = self._upstream(index, url)
                if self.upstreams:
                    logger.info("upstream %s joined (index %d)", url, index)
                    self._membership("joined")
            members.append(upstream)
        for upstream in known.values():
            logger.info("upstream %s left", upstream.url)
            self._membership("left")
            self._draining.append(upstream)
        self.upstreams = sorted(members, key=lambda u: u.index)
        self.router = UpstreamRouter([u.url for u in self.upstreams], self.settings.routing)

    def _upstream(self, index: int, url: str) -> Upstream:
        settings = self.settings
        breaker = Breaker(
            settings.upstream_unhealthy_after,
            settings.upstream_healthy_after,
            settings.upstream_cooldown_s,
        )
        return Upstream(
            index,
            url,
            breaker,
            settings.upstream_connect_timeout_s,
            settings.upstream_read_timeout_s,
            settings.upstream_api_key,
        )

    def _membership(self, event: str) -> None:
        self.observed.count("kvgate_upstream_membership", event=event)

    async def refresh(self) -> None:
        """Re-resolve the ``--upstream-dns`` names: addresses that appeared join once they
        serve the fleet's model, those gone leave. A name that fails keeps what it had."""
        for target in self.targets:
            try:
                self._resolved[target] = await asyncio.to_thread(target.urls, self._resolve)
            except OSError as exc:
                logger.warning(
                    "upstream-dns %s: %s; keeping its %d upstream(s)",
                    target.host,
                    exc,
                    len(self._resolved.get(target, ())),
                )
                self.observed.count("kvgate_upstream_dns_errors")
        wanted = union(self.listed, self._resolved)
        current = {u.url for u in self.upstreams}
        joining = [url for url in wanted if url not in current]
        verdicts = await asyncio.gather(*(self._serves_our_model(url) for url in joining))
        admitted = {url for url, ok in zip(joining, verdicts, strict=True) if ok}
        self._set_members([url for url in wanted if url in current or url in admitted])
        drained = [u for u in self._draining if u.in_flight == 0]
        self._draining = [u for u in self._draining if u.in_flight > 0]
        await asyncio.gather(*(u.aclose() for u in drained))

    async def _serves_our_model(self, url: str) -> bool:
        """May a new address join: does its ``/v1/models`` name the fleet's model?"""
        timeout = self.settings.upstream_connect_timeout_s
        key_header = headers(self.settings.upstream_api_key)
        try:
            name, _ = await served_model(url, timeout, key_header)
        except PROBE_ERRORS as exc:
            logger.info("upstream %s is not serving yet (%s)", url, exc)
            return False
        if name != self.model_name:
            logger.warning("upstream %s serves %r, not %r: not joined", url, name, self.model_name)
            self._membership("refused")
            return False
        return True


def union(static: tuple[str, ...], resolved: dict[DnsTarget, list[str]]) -> list[str]:
    """Every member URL once: the configured ones first, then the resolved ones."""
    return list(dict.fromkeys([*static, *(url for urls in resolved.values() for url in urls)]))


async def served_model(url: str, timeout_s: float, key_header: dict[str, str]) -> tuple[str, int]:
    """(model id, max_model_len or 0) from the address's ``/v1/models`` (``PROBE_ERRORS``)."""
    entry = (await bounded.models(url, timeout_s, key_header))["data"][0]
    return str(entry["id"]), int(entry.get("max_model_len") or 0)


async def ask_all(
    urls: list[str], timeout_s: float, key_header: dict[str, str]
) -> list[tuple[str, int] | BaseException]:
    """Each address's served model, or what asking it failed with, all asked at once."""
    asked = [served_model(url, timeout_s, key_header) for url in urls]
    answers = await asyncio.gather(*asked, return_exceptions=True)
    for answer in answers:
        if isinstance(answer, BaseException) and not isinstance(answer, PROBE_ERRORS):
            raise answer
    return answers
