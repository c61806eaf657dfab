"""Runtime catalog changes, kept consistent across every process that shares one Redis.

A change starts in one process (SIGHUP, or ``POST /admin/catalog/reload``): it rebuilds its
catalog from its config, serves it at once and publishes the new version. Every other process
hears that version; one that does not serve it cannot build it from the version alone (a
version is a content hash), so it re-reads its own config, which the processes share (one
file, one ConfigMap), and serves what that yields, re-reading for a while if that is not yet
the announced version (a file can reach processes at different times). Only then are this process's
``subscriptions/listen`` streams told (``versions()``), so a client that lists again after a
``list_changed`` gets the new catalog from the process that told it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass

from kvgate.gateway.catalog.catalog import Catalog, CatalogHolder
from kvgate.gateway.catalog.config import CatalogConfigError
from kvgate.gateway.catalog.discovery_cache import DiscoveryCache, VersionFanout
from kvgate.gateway.ops.metrics import Metrics

log = logging.getLogger(__name__)
REREAD_DELAYS_S = (1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0)  # ~2 min: a ConfigMap's sync time


@dataclass(frozen=True)
class Reload:
    previous: str
    version: str

    @property
    def changed(self) -> bool:
        return self.version != self.previous


class CatalogReloader:
    """Rebuilds the served catalog on request or when another process announces a change."""

    def __init__(
        self,
        served: CatalogHolder,
        cache: DiscoveryCache,
        build: Callable[[], Catalog],
        metrics: Metrics,
    ) -> None:
        self.served = served
        self.cache = cache
        self._build = build  # reads the config; raises CatalogConfigError when it is bad
        self._metrics = metrics
        self._listeners = VersionFanout()
        self._listeners.latest = served.current.version
        self._follower: asyncio.Task[None] | None = None
        self._closed = False
        self.reread_delays_s = REREAD_DELAYS_S

    def start(self) -> None:
        """Follow versions announced through the discovery cache (by anyone, from now on)."""
        self._follower = asyncio.create_task(
            self._follow(self.cache.versions()), name="kvgate-catalog-follow"
        )

    async def reload(self, trigger: str) -> Reload:
        """Re-read the config here; serve and publish the result if it changed."""
        try:
            catalog = self._build()
        except CatalogConfigError:
            self._metrics.count("kvgate_catalog_reloads", trigger=trigger, outcome="error")
            raise
        result = await self.serve(catalog)
        self._metrics.count(
            "kvgate_catalog_reloads",
            trigger=trigger,
            outcome="changed" if result.changed else "unchanged",
        )
        return result

    async def serve(self, catalog: Catalog) -> Reload:
        """Serve ``catalog`` now and, if it is new, announce it here and to every process.
        (Other processes follow by re-reading their config, as on any announced change.)"""
        result = self._use(catalog)
        if result.changed:
            await self.cache.publish_version(result.version)
        return result

    def versions(self) -> AsyncIterator[str]:
        """Versions this process has started serving, for listen streams; ends on `close()`."""
        if self._closed:
            return _nothing()
        return self._listeners.subscribe()

    def end_listen_streams(self) -> None:
        """End every listen stream now, gracefully (each gets its final result); a listen
        request arriving later ends at once. For draining before shutdown."""
        self._closed = True
        self._listeners.close()

    async def close(self) -> None:
        self.end_listen_streams()
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower

    def _use(self, catalog: Catalog) -> Reload:
        previous = self.served.current.version
        if catalog.version != previous:
            self.served.swap(catalog)
            self._listeners.announce(catalog.version)
            log.info("catalog version %s -> %s", previous, catalog.version)
        return Reload(previous, catalog.version)

    async def _follow(self, versions: AsyncIterator[str]) -> None:
        """Re-read the config whenever another version is announced; while it does not yield
        that version (the file may reach this process later, as a mounted ConfigMap does),
        re-read again after each of `reread_delays_s`, until it does or a newer one comes."""
        pending: asyncio.Future[str] | None = None
        wanted: str | None = None
        delays: Iterator[float] = iter(())
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(anext(versions))
                timeout = next(delays, None) if wanted is not None else None
                if wanted is not None and timeout is None:
                    log.info(
                        "catalog %s announced; this process serves %s (from its config)",
                        wanted,
                        self.served.current.version,
                    )
                    wanted = None
                done, _ = await asyncio.wait((pending,), timeout=timeout)
                if done:
                    try:
                        version = pending.result()
                    except StopAsyncIteration:
                        return
                    pending = None
                    if version == self.served.current.version:
                        wanted = None  # ours, or one we already serve
                        continue
                    wanted, delays = version, iter(self.reread_delays_s)
                if wanted is not None and self._reread() == wanted:
                    wanted = None
        finally:
            if pending is not None:
                pending.cancel()

    def _reread(self) -> str:
        """Rebuild from the config as a follower; the version served afterwards."""
        try:
            result = self._use(self._build())
        except CatalogConfigError as exc:
            self._metrics.count("kvgate_catalog_reloads", trigger="peer", outcome="error")
            log.warning(
                "catalog config not loaded, still serving %s: %s",
                self.served.current.version,
                exc,
            )
            return self.served.current.version
        self._metrics.count(
            "kvgate_catalog_reloads",
            trigger="peer",
            outcome="changed" if result.changed else "unchanged",
        )
        return result.version


async def _nothing() -> AsyncIterator[str]:
    return
    yield  # an async generator that ends at once
