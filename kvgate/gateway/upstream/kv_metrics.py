"""What the KV-event subscription did, per upstream, read from the subscriber at scrape time.

An operator needs to see whether precise routing is working from its inputs: a publisher
that drops batches (``gaps``), a gateway that had to catch up (``replayed``), events that
could not be placed (``dropped``: an unknown parent or an inconsistent block), a publisher
over its budget (``throttled``) or sending garbage (``malformed``), a subscription that went
down (``disconnected``), and how many blocks each index holds:

    kvgate_upstream_kv_events_total{upstream, url, kind}
    kvgate_upstream_kv_events_live{upstream, url}       1 while its events are followed
    kvgate_upstream_kv_index_blocks{upstream, url}

``upstream`` is the member's index, as in the other ``kvgate_upstream_*`` series (empty for
an event source naming no current member). Every kind is exported from the start (0), so a
rate over them is defined before the first gap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.gateway.upstream.kv_subscriber import KVSubscriber
from kvgate.gateway.upstream.upstream import Upstream

KINDS = (
    "batches",
    "replayed",
    "gaps",
    "dropped",
    "throttled",
    "malformed",
    "connected",
    "disconnected",
)


class KVEventsCollector(Collector):
    def __init__(self, subscriber: KVSubscriber, members: Callable[[], Sequence[Upstream]]) -> None:
        self._subscriber = subscriber
        self._members = members

    def collect(self) -> Iterator[Metric]:
        labels = ["upstream", "url"]
        events = CounterMetricFamily(
            "kvgate_upstream_kv_events",
            "KV-cache event batches applied, replayed, and the subscription's troubles, by kind.",
            labels=[*labels, "kind"],
        )
        live = GaugeMetricFamily(
            "kvgate_upstream_kv_events_live",
            "1 while the upstream's KV-cache events are followed (precise routing on).",
            labels=labels,
        )
        blocks = GaugeMetricFamily(
            "kvgate_upstream_kv_index_blocks",
            "Blocks the upstream holds, as its KV-cache events tell (capped).",
            labels=labels,
        )
        index_of = {u.url.rstrip("/"): str(u.index) for u in self._members()}
        for url, state in self._subscriber.states().items():
            names = [index_of.get(url, ""), url]
            for kind in KINDS:
                events.add_metric([*names, kind], state.counts.get(kind, 0))
            live.add_metric(names, float(state.live))
            blocks.add_metric(names, state.blocks)
        yield from (events, live, blocks)
