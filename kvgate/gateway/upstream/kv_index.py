"""Which blocks one upstream holds, as its KV-cache events tell: keyed by token content.

A block's key is computed here from what the event carries, never taken from the engine:

    key0 = sha256(ROOT ‖ block size ‖ tokens[0:B] as int32 ‖ extra keys of block 0)[:16]
    keyN = sha256(keyN-1 ‖ block size ‖ tokens[N·B:(N+1)·B] ‖ extra keys of block N)[:16]

where the extra keys are vLLM's published ones (the LoRA adapter's name on every block,
then the tenant's cache salt on the first: ``request_keys`` builds the same for a call), as
llm-d does, so kvgate depends on no engine's hash function and an upstream's events cannot
name a key for content they do not carry. A stored event's first block chains from its
parent, found by the engine's hash in this index (an unknown parent: the event cannot be
placed and is dropped). Equal content under another salt or adapter is another key, so a
tenant's prefixes never match another's.

Bounded: at most ``max_blocks`` engine hashes per upstream, least recently stored evicted
first, and speculative entries (a call just routed here, until its events arrive) at most
``max_blocks`` too, each for ``SPECULATIVE_S``. An upstream flooding or lying fills only its
own index. The subscriber's thread writes, the event loop reads: one lock, held for dict
operations only.
"""

from __future__ import annotations

import hashlib
import math
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec

from kvgate.engine.process import kv_wire
from kvgate.gateway.upstream.decaying import DecayingSum

ROOT = hashlib.sha256(b"kvgate-kv-content-v1").digest()[:16]
KEY_BYTES = 16
SPECULATIVE_S = 3.0  # a routed call's blocks are assumed there this long, until events say
EVICTION_WINDOW_S = 10.0  # the time constant of the eviction rate: about an agent's turn


def _extras(keys: Sequence[Any] | None) -> bytes:
    return msgspec.msgpack.encode(list(keys)) if keys else b""


def _chain(
    parent: bytes, token_ids: Sequence[int], block_size: int, extras: Sequence[bytes]
) -> list[bytes]:
    keys = []
    size = block_size.to_bytes(4, "little")
    for n, extra in enumerate(extras):
        block = token_ids[n * block_size : (n + 1) * block_size]
        packed = struct.pack(f"<{len(block)}i", *block)
        parent = hashlib.sha256(parent + size + packed + extra).digest()[:KEY_BYTES]
        keys.append(parent)
    return keys


def request_keys(
    token_ids: Sequence[int], block_size: int, lora_name: str | None, salt: str | None
) -> list[bytes]:
    """The keys of a call's full blocks, as its upstream's events would give them."""
    count = len(token_ids) // block_size
    if count == 0:
        return []
    first = tuple(k for k in (lora_name, salt) if k)
    rest = _extras((lora_name,) if lora_name else None)
    return _chain(ROOT, token_ids, block_size, [_extras(first)] + [rest] * (count - 1))[:count]


def engine_hash(value: bytes | int) -> bytes:
    return value if isinstance(value, bytes) else value.to_bytes(16, "big", signed=True)


def eviction_odds(held: int, recent: float) -> float:
    """The chance that blocks a cache holding ``held`` blocks stores now are gone before the
    conversation's next turn, about ``EVICTION_WINDOW_S`` away, where it removed ``recent``
    blocks over that window. An engine evicts its least recently used blocks first, so a
    call's blocks, the newest, go only once the blocks evicted since outnumber those held
    before them: with the recent evictions as the rate and an exponential pause,
    ``exp(-held / recent)``. A cache that holds its callers' working set removes little
    (about 0); one whose whole cache turns over in a pause often loses a paused
    conversation's history (0.37 when it removes as much as it holds, 0.72 at three times)."""
    return math.exp(-held / recent) if recent > 0 else 0.0


class BlockIndex:
    """One upstream's blocks: engine hash → content key, and the keys held."""

    def __init__(self, max_blocks: int) -> None:
        self.max_blocks = max_blocks
        self.block_size: int | None = None
        self._lock = threading.Lock()
        self._by_engine: OrderedDict[bytes, bytes] = OrderedDict()
        self._held: dict[bytes, int] = {}  # content key → engine hashes naming it
        self._speculative: OrderedDict[bytes, float] = OrderedDict()  # key → until
        self._evictions = DecayingSum(EVICTION_WINDOW_S)  # blocks the engine removed

    def __len__(self) -> int:
        return len(self._by_engine)

    def stored(self, event: kv_wire.BlockStored) -> bool:
        """Record the event's blocks; False when it is inconsistent or cannot be chained."""
        count, size = len(event.block_hashes), event.block_size
        extras = event.extra_keys
        if count == 0 or len(event.token_ids) != count * size:
            return False
        if extras is not None and len(extras) != count:
            return False
        if extras is None and event.lora_name:
            extras = [(event.lora_name,)] * count
        with self._lock:
            if self.block_size is not None and size != self.block_size:
                return False
            if event.parent_block_hash is None:
                parent: bytes | None = ROOT
            else:
                parent = self._by_engine.get(engine_hash(event.parent_block_hash))
            if parent is None:
                return False
            self.block_size = size
        blobs = [_extras(e) for e in extras] if extras is not None else [b""] * count
        keys = _chain(parent, event.token_ids, size, blobs)  # hashed outside the lock
        with self._lock:
            for value, key in zip(event.block_hashes, keys, strict=True):
                self._put(engine_hash(value), key)
        return True

    def removed(self, hashes: Sequence[bytes | int], now: float | None = None) -> None:
        """The engine dropped these blocks: evicted them for others (counted in
        ``eviction_odds``) or freed them."""
        now = time.monotonic() if now is None else now
        with self._lock:
            gone = 0
            for value in hashes:
                key = self._by_engine.pop(engine_hash(value), None)
                if key is not None:
                    self._release(key)
                    gone += 1
            self._evictions.add(gone, now)

    def eviction_odds(self, now: float) -> float:
        """The chance that blocks just stored here are gone before the conversation's next
        turn (``eviction_odds``, from the blocks held and those removed lately)."""
        with self._lock:
            held = len(self._by_engine)
            recent = self._evictions.value(now)
        return eviction_odds(held, recent)

    def clear(self) -> None:
        with self._lock:
            self._by_engine.clear()
            self._held.clear()
            self._speculative.clear()
            self._evictions.clear()

    def match(self, keys: Sequence[bytes], now: float) -> int:
        """How many of ``keys``, from the first, are held here (or speculatively)."""
        with self._lock:
            for n, key in enumerate(keys):
                if key in self._held:
                    continue
                until = self._speculative.get(key)
                if until is None or until < now:
                    return n
            return len(keys)

    def speculate(self, keys: Sequence[bytes], now: float) -> None:
        """A call with these blocks was just sent here: count them as held for a while."""
        until = now + SPECULATIVE_S
        with self._lock:
            speculative = self._speculative
            for key in keys:
                speculative[key] = until
                speculative.move_to_end(key)
            while len(speculative) > self.max_blocks:
                speculative.popitem(last=False)

    def _put(self, engine: bytes, key: bytes) -> None:
        old = self._by_engine.pop(engine, None)
        if old is not None:
            self._release(old)
        self._by_engine[engine] = key
        self._held[key] = self._held.get(key, 0) + 1
        self._speculative.pop(key, None)
        while len(self._by_engine) > self.max_blocks:
            _, evicted = self._by_engine.popitem(last=False)
            self._release(evicted)

    def _release(self, key: bytes) -> None:
        left = self._held[key] - 1
        if left:
            self._held[key] = left
        else:
            del self._held[key]
