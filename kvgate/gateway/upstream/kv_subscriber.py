"""Subscribe to the upstreams' KV-cache events and keep each one's ``BlockIndex``.

``--upstream-kv-events URL=tcp://host:5557[,replay=tcp://host:5558][,topic=kv-events]``
names an upstream's publisher (vLLM's ``--kv-events-config``, or kvgate's). One thread per
gateway process reads every publisher (ZMQ sockets belong to one thread; decoding and
hashing stay off the event loop), so with ``--workers N`` each process subscribes on its
own and builds the same index from the same events: nothing is shared, nothing to agree on.

Sequence numbers: batches come numbered; a gap (a batch dropped at a high-water mark) or a
first connection (a gateway started or restarted mid-trace) asks the replay endpoint for
the batches from the one missed on; a replay that cannot cover the gap (no endpoint, no
answer within ``REPLAY_S``, or the publisher's buffer no longer holds it) clears that
index, which then routes on fewer blocks than are cached, never on blocks that are gone.
A disconnect (the publisher stopped or restarted) makes the index not ``live`` and cleared:
calls fall back to hash routing until it reconnects and replays.

Hostile publishers: a message is at most ``MAX_MESSAGE_BYTES`` (ZMQ drops larger ones
unread), decoding is typed and bounded (``kv_wire``), and each publisher has a budget of
bytes and tokens per second: past it, its socket is not read for the rest of that second
(ZMQ drops what piles up, and the gap that leaves is replayed, within the same budget).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvgate.engine.process import kv_wire
from kvgate.gateway.upstream.kv_index import BlockIndex

logger = logging.getLogger("kvgate.fleet")
MAX_MESSAGE_BYTES = 4 << 20
RECEIVE_HWM = 10_000  # batches queued per publisher before ZMQ drops
REPLAY_S = 2.0  # for a replay's whole answer
BYTES_PER_S = 32 << 20  # each publisher's budget
TOKENS_PER_S = 2_000_000  # tokens hashed: ~125k sha256 blocks, ~0.1 s of one core
POLL_MS = 100
CONNECTED = zmq.EVENT_HANDSHAKE_SUCCEEDED
DISCONNECTED = zmq.EVENT_DISCONNECTED


@dataclass(frozen=True)
class EventSource:
    url: str  # the upstream's base URL, as given to --upstream
    endpoint: str
    replay: str | None = None
    topic: str = ""

    @classmethod
    def parse(cls, spec: str) -> EventSource:
        """``URL=tcp://host:port[,replay=tcp://host:port][,topic=NAME]`` (ValueError)."""
        url, sep, rest = spec.partition("=")
        parts = rest.split(",")
        if not sep or not url.startswith(("http://", "https://")) or "://" not in parts[0]:
            raise ValueError(
                f"--upstream-kv-events {spec!r}: URL=tcp://HOST:PORT[,replay=tcp://HOST:PORT]"
            )
        options: dict[str, str] = {}
        for part in parts[1:]:
            name, _, value = part.partition("=")
            if name not in ("replay", "topic") or not value:
                raise ValueError(f"--upstream-kv-events {spec!r}: unknown option {part!r}")
            options[name] = value
        return cls(url.rstrip("/"), parts[0], options.get("replay"), options.get("topic", ""))


@dataclass(frozen=True)
class FeedState:
    counts: dict[str, int]  # by kind: batches, replayed, gaps, dropped, throttled, ...
    live: bool
    blocks: int


@dataclass
class _Feed:
    """One publisher: its sockets, the next sequence number expected and its budget."""

    source: EventSource
    index: BlockIndex
    sub: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    live: bool = False
    next_seq: int | None = None  # None: not synced (replay from the start of its buffer)
    window: float = 0.0
    spent_bytes: int = 0
    spent_tokens: int = 0
    paused_until: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n


class KVSubscriber:
    """The thread and the per-upstream indexes it keeps (``live_index``)."""

    def __init__(self, sources: list[EventSource], max_blocks: int) -> None:
        self.sources, self.max_blocks = sources, max_blocks
        self._context: zmq.Context[zmq.Socket[bytes]] | None = None
        self._feeds: dict[str, _Feed] = {}
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvgate-kv-events", daemon=True)

    def start(self) -> None:
        """Connect and follow, in the process that serves (ZMQ sockets do not survive a
        fork, and the gateway may fork its workers after building the fleet)."""
        self._context = context = zmq.Context()
        for source in self.sources:
            sub = context.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
            sub.setsockopt(zmq.RECONNECT_IVL, 100)
            sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
            sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
            monitor = sub.get_monitor_socket(CONNECTED | DISCONNECTED)
            sub.connect(source.endpoint)
            self._feeds[source.url] = _Feed(source, BlockIndex(self.max_blocks), sub, monitor)
        self._thread.start()

    def close(self) -> None:
        self._running = False
        if self._thread.is_alive():
            self._thread.join(timeout=2.0)
        if self._context is not None:
            self._context.destroy(linger=0)

    def live_index(self, url: str) -> BlockIndex | None:
        """The upstream's index while its events are being followed; else None."""
        feed = self._feeds.get(url.rstrip("/"))
        return feed.index if feed is not None and feed.live else None

    def states(self) -> dict[str, FeedState]:
        """Each upstream's subscription now, by URL (``kv_metrics`` exports them)."""
        return {
            url: FeedState(dict(feed.counts), feed.live, len(feed.index))
            for url, feed in self._feeds.items()
        }

    # -- the thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while self._running:
            poller = zmq.Poller()
            now = time.monotonic()
            for feed in self._feeds.values():
                poller.register(feed.monitor, zmq.POLLIN)
                if feed.paused_until <= now:
                    poller.register(feed.sub, zmq.POLLIN)
            ready = dict(poller.poll(POLL_MS))
            for feed in self._feeds.values():
                try:
                    if feed.monitor in ready:
                        self._on_monitor(feed)
                    if feed.sub in ready:
                        self._drain(feed)
                except Exception:  # noqa: BLE001 - one publisher's fault must not end the thread
                    logger.exception("KV events from %s", feed.source.endpoint)
                    feed.index.clear()
                    feed.next_seq = None

    def _on_monitor(self, feed: _Feed) -> None:
        while feed.monitor.poll(0):
            event = recv_monitor_message(feed.monitor)["event"]
            if event == CONNECTED:
                feed.live, feed.next_seq = True, None
                feed.index.clear()
                self._replay(feed, 0)
                feed.count("connected")
            elif event == DISCONNECTED:
                feed.live, feed.next_seq = False, None
                feed.index.clear()
                feed.count("disconnected")

    def _drain(self, feed: _Feed) -> None:
        for _ in range(64):  # then the others' turn
            if not feed.sub.poll(0) or not self._within_budget(feed):
                return
            frames = feed.sub.recv_multipart()
            if len(frames) != 3 or len(frames[1]) != 8:
                feed.count("malformed")
                continue
            seq = kv_wire.seq_of(frames[1])
            if feed.next_seq is None or seq > feed.next_seq:
                self._replay(feed, 0 if feed.next_seq is None else feed.next_seq)
                if feed.next_seq is not None and seq > feed.next_seq:
                    feed.count("gaps")
                    feed.index.clear()  # the replay could not cover the gap
            if feed.next_seq is not None and seq < feed.next_seq:
                continue  # replayed already
            self._apply(feed, seq, frames[2])

    def _replay(self, feed: _Feed, start: int) -> None:
        """Apply the publisher's buffered batches from ``start`` on (all it answers within
        ``REPLAY_S``)."""
        if feed.source.replay is None:
            return
        assert self._context is not None
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        try:
            dealer.connect(feed.source.replay)
            dealer.send_multipart((b"", kv_wire.seq_bytes(start)))
            deadline = time.monotonic() + REPLAY_S
            while (left := deadline - time.monotonic()) > 0 and dealer.poll(int(left * 1000)):
                frames = dealer.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    feed.count("malformed")
                    return
                seq = kv_wire.seq_of(frames[2])
                if seq < 0:
                    return
                if (feed.next_seq is None or seq >= feed.next_seq) and self._within_budget(feed):
                    self._apply(feed, seq, frames[3])
                    feed.count("replayed")
        finally:
            dealer.close(linger=0)

    def _apply(self, feed: _Feed, seq: int, payload: bytes) -> None:
        feed.next_seq = seq + 1
        feed.spent_bytes += len(payload)
        try:
            batch = kv_wire.decode(payload)
        except kv_wire.DecodeError:
            feed.count("malformed")
            return
        index = feed.index
        for event in batch.events:
            if isinstance(event, kv_wire.BlockStored):
                feed.spent_tokens += len(event.token_ids)
                if not index.stored(event):
                    feed.count("dropped")
            elif isinstance(event, kv_wire.BlockRemoved):
                index.removed(event.block_hashes)
            else:
                index.clear()
        feed.count("batches")

    def _within_budget(self, feed: _Feed) -> bool:
        now = time.monotonic()
        if now - feed.window >= 1.0:
            feed.window, feed.spent_bytes, feed.spent_tokens = now, 0, 0
        if feed.spent_bytes < BYTES_PER_S and feed.spent_tokens < TOKENS_PER_S:
            return True
        feed.paused_until = feed.window + 1.0
        feed.count("throttled")
        return False
