"""The routing decision: which member takes a call, and what a call needs of the fleet.

``Chooser`` weighs the members' health and load (``routing``) for each attempt: the upstream a
placement record names while it is routable, untried and not pressed, else the router's
choice, counted by reason in ``kvgate_upstream_routing``. ``Route`` is all a call (``call``)
and a proxied request (``proxies``) know of the fleet: where to go next, and where to say
that an attempt failed.
"""

from __future__ import annotations

import time
from typing import Protocol

from kvgate.gateway.upstream.failures import AttemptFailed
from kvgate.gateway.upstream.fleet_metrics import FleetMetrics
from kvgate.gateway.upstream.membership import Membership
from kvgate.gateway.upstream.precise import PreciseScorer, PromptBlocks
from kvgate.gateway.upstream.routing import Load
from kvgate.gateway.upstream.upstream import Upstream

SCRAPES_FRESH = 3  # a scrape older than this many intervals is no longer routed on


class Route(Protocol):
    def choose(
        self,
        hashes: list[bytes],
        cache_key: str | None,
        tried: set[int],
        placed: Upstream | None = None,
        prompt: PromptBlocks | None = None,
    ) -> Upstream:
        """The upstream for the next attempt (``EngineUnavailable`` when none can take it);
        ``prompt``: the call's blocks, for precise routing."""
        ...

    def failed(self, upstream: Upstream, failure: AttemptFailed) -> None:
        """An attempt on ``upstream`` failed: its health and the error counts hear of it."""
        ...


class Chooser:
    """The ``Route`` the fleet gives its calls and proxies."""

    def __init__(
        self,
        members: Membership,
        observed: FleetMetrics,
        scrape_interval_s: float,
        precise: PreciseScorer | None = None,
    ):
        self.members = members
        self.observed = observed
        self._max_age_s = SCRAPES_FRESH * scrape_interval_s
        self.precise = precise

    def choose(
        self,
        hashes: list[bytes],
        cache_key: str | None,
        tried: set[int],
        placed: Upstream | None = None,
        prompt: PromptBlocks | None = None,
    ) -> Upstream:
        """The upstream for a call: where its KV-cache events say its longest prefix is,
        weighed against load (``precise``); else the one its placement record names
        (``placed``) while it is available, untried and not pressed; else the router's
        choice. Which rule decided is counted in ``kvgate_routing_decisions{rule}``."""
        members, max_age = self.members.upstreams, self._max_age_s
        reason = "placed"
        upstream = placed
        now = time.monotonic()
        if self.precise is not None and prompt is not None:
            available = [u.breaker.available() and u.index not in tried for u in members]
            if any(available):
                loads = [u.load(max_age) for u in members]
                urls = [u.url for u in members]
                position = self.precise.choose(prompt, urls, loads, available, now)
                if position is not None:
                    upstream, reason = members[position], "precise"
        if reason != "precise" and (
            upstream is None
            or upstream.index in tried
            or not upstream.breaker.available()
            or upstream.load(max_age).pressed
        ):
            available = [u.breaker.available() and u.index not in tried for u in members]
            loads = [u.load(max_age) for u in members]
            position, reason = self.members.router.choose(hashes, cache_key, loads, available)
            upstream = members[position]
        assert upstream is not None
        if self.precise is not None and prompt is not None:
            self.precise.routed(prompt, upstream.url, now)
        self.observed.count("kvgate_upstream_routing", upstream=str(upstream.index), reason=reason)
        self.observed.count("kvgate_routing_decisions", rule=reason)
        return upstream

    def own(self, hashes: list[bytes], cache_key: str | None) -> Upstream | None:
        """The upstream the hash gives the call's key, load aside."""
        members = self.members.upstreams
        available = [u.breaker.available() for u in members]
        if not any(available):
            return None
        idle = [Load(0)] * len(members)
        return members[self.members.router.choose(hashes, cache_key, idle, available)[0]]

    def failed(self, upstream: Upstream, failure: AttemptFailed) -> None:
        self.members.failed(upstream, failure)

    def load(self, upstream: Upstream) -> int:
        return upstream.load(self._max_age_s).total
