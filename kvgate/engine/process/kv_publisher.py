"""Publish the block pool's KV-cache events as vLLM does: ``--kv-events-config``.

The config is vLLM's JSON, e.g. ``{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}``
(``buffer_steps``, ``hwm`` too). One background thread owns both sockets (ZMQ sockets are
not thread-safe): it drains the pool's ``KVEventLog`` — the replica step threads only
append to it, so the hot path pays a dict insert per block — into one ``EventBatch`` per
wake-up (a step's worth, or several when steps are short), sends it on the PUB socket with
its sequence number, keeps the last ``buffer_steps`` batches, and answers replay requests
on the ROUTER (``kv_wire``). The replicas share one pool, so one publisher covers every
replica: ``data_parallel_rank`` is 0.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

import zmq

from kvgate.engine.core.block_hash import BLOCK_SIZE
from kvgate.engine.core.block_pool import BlockPool
from kvgate.engine.core.kv_events import Cleared, Event, KVEventLog, Removed, Stored
from kvgate.engine.process import kv_wire

log = logging.getLogger("kvgate.kv_events")
DRAIN_WAIT_S = 0.05  # how long the thread waits for events before serving replays again
MEDIUM = "GPU"  # vLLM's name for the engine's own KV cache, whatever the device


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``KVEventsConfig`` fields that kvgate honours."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    topic: str = ""

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """The JSON ``--kv-events-config`` names (ValueError saying what is wrong)."""
        try:
            given = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(given, dict):
            raise ValueError("--kv-events-config: a JSON object")
        known = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for name, value in given.items():
            if name in ("max_queue_size",):  # vLLM's own queue: kvgate's log is bounded anyway
                continue
            if name not in known:
                raise ValueError(f"--kv-events-config: unknown field {name!r}")
            values[name] = value
        config = cls(**values)
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher {config.publisher!r}: zmq or null")
        if not (1 <= int(config.buffer_steps) <= 1_000_000 and 1 <= int(config.hwm)):
            raise ValueError("--kv-events-config: buffer_steps 1..1000000 and hwm >= 1")
        return config

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def wire_event(event: Event) -> kv_wire.Event:
    if isinstance(event, Stored):
        return kv_wire.BlockStored(
            list(event.block_hashes),
            event.parent_hash,
            event.token_ids,
            event.block_size,
            None,
            MEDIUM,
            event.lora_name,
            list(event.extra_keys) if event.extra_keys is not None else None,
        )
    if isinstance(event, Removed):
        return kv_wire.BlockRemoved(list(event.block_hashes), MEDIUM)
    assert isinstance(event, Cleared)
    return kv_wire.AllBlocksCleared()


class KVEventPublisher:
    """The PUB and replay sockets and the thread that feeds them from ``events``."""

    def __init__(self, config: KVEventsConfig, events: KVEventLog) -> None:
        self.config, self.events = config, events
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if "*" in config.endpoint or config.endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay: zmq.Socket[bytes] | None = None
        if config.replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvgate-kv-events", daemon=True)
        self._thread.start()
        log.info("publishing KV-cache events on %s", config.endpoint)

    def _run(self) -> None:
        while self._running:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay(self._replay)
            events = self.events.drain(DRAIN_WAIT_S)
            if events:
                self._publish(events)

    def _publish(self, events: list[Event]) -> None:
        batch = kv_wire.EventBatch(time.time(), [wire_event(e) for e in events], 0)
        payload = kv_wire.encode(batch)
        seq = kv_wire.seq_bytes(self._seq)
        self._pub.send_multipart((self._topic, seq, payload))
        self._buffer.append((self._seq, payload))
        self._seq += 1

    def _serve_replay(self, replay: zmq.Socket[bytes]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            return  # not a replay request: ignored, as vLLM does
        client, _, start = frames
        first = kv_wire.seq_of(start)
        for seq, payload in self._buffer:
            if seq >= first:
                replay.send_multipart((client, b"", self._topic, kv_wire.seq_bytes(seq), payload))
        replay.send_multipart((client, b"", b"", kv_wire.END_SEQ, b""))

    def close(self) -> None:
        self._running = False
        self._thread.join(timeout=1.0)
        self._context.destroy(linger=0)


def start_publisher(config_json: str | None, pool: BlockPool) -> KVEventPublisher | None:
    """A publisher of ``pool``'s events when ``config_json`` asks for one (ValueError for a
    bad config); the pool logs its events from then on."""
    if config_json is None:
        return None
    config = KVEventsConfig.parse(config_json)
    if not config.publishes:
        return None
    pool.events = KVEventLog(BLOCK_SIZE)
    return KVEventPublisher(config, pool.events)
