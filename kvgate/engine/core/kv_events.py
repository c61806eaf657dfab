"""What the block pool caches, told as it changes: the KV-cache events a router subscribes to.

The pool's changes become vLLM's three events (``kvgate.engine.process.kv_publisher`` puts them on
the wire), so llm-d, Dynamo and kvgate's own fleet route on where blocks really are:

    registered  (pending)  →  written (the step that computes it ended)  →  ``stored``
    cached, then evicted or reused for new content                       →  ``removed``

A block is told as stored only once the step that wrote it has finished (``mark_ready``):
one registered and then released unwritten (a preempted or aborted request, tokens rolled
back) is forgotten, never told. A stored event names the blocks' hashes, the parent's hash
(None for a prompt's first block), the token ids they hold, the LoRA adapter's name and,
per block, vLLM's extra keys: the adapter's name, then the tenant's cache salt on the first
block. The log is bounded: when nobody drains it (a stalled publisher), it is replaced by
one ``cleared`` event, which a subscriber reads as "forget this engine's blocks": it then
routes on fewer blocks than are cached, never on blocks that are gone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MAX_EVENTS = 65_536  # undrained events kept before the log collapses to one ``cleared``


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: list[bytes]
    parent_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None
    extra_keys: list[tuple[str, ...] | None] | None


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: list[bytes]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class _Pending:
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: Sequence[int]
    lora_name: str | None
    salt: str | None


class KVEventLog:
    """The pool's events since the last ``drain``; every method is thread-safe and cheap
    (a dict insert or a list append under its own lock), as replica step threads call it."""

    def __init__(self, block_size: int, max_events: int = MAX_EVENTS) -> None:
        self.block_size = block_size
        self.max_events = max_events
        self._lock = threading.Condition(threading.Lock())
        self._pending: dict[int, _Pending] = {}
        self._events: list[Event] = []

    def registered(
        self,
        block: int,
        block_hash: bytes,
        parent_hash: bytes | None,
        token_ids: Sequence[int],
        lora_name: str | None,
        salt: str | None,
    ) -> None:
        """``block`` will hold ``token_ids`` once its step has written it."""
        with self._lock:
            self._pending[block] = _Pending(block_hash, parent_hash, token_ids, lora_name, salt)

    def written(self, blocks: Iterable[int]) -> None:
        """The step that wrote ``blocks`` ended: each run of parent-chained blocks is one
        ``Stored``."""
        with self._lock:
            run: list[_Pending] = []
            for block in blocks:
                entry = self._pending.pop(block, None)
                if entry is None:
                    continue
                if run and (
                    entry.parent_hash != run[-1].block_hash or entry.lora_name != run[0].lora_name
                ):
                    self._append(self._stored(run))
                    run = []
                run.append(entry)
            if run:
                self._append(self._stored(run))

    def uncached(self, block: int, block_hash: bytes, was_ready: bool) -> None:
        """``block`` no longer caches ``block_hash``: told if it had been stored."""
        with self._lock:
            if was_ready:
                self._append(Removed([block_hash]))
            else:
                self._pending.pop(block, None)

    def drain(self, timeout_s: float) -> list[Event]:
        """The events since the last drain, waiting up to ``timeout_s`` for the first."""
        with self._lock:
            if not self._events:
                self._lock.wait(timeout_s)
            events, self._events = self._events, []
            return events

    def _stored(self, run: list[_Pending]) -> Stored:
        first = run[0]
        tokens = [t for entry in run for t in entry.token_ids]
        extras = [_extra_keys(e.lora_name, e.salt if e.parent_hash is None else None) for e in run]
        return Stored(
            [entry.block_hash for entry in run],
            first.parent_hash,
            tokens,
            self.block_size,
            first.lora_name,
            extras if any(extras) else None,
        )

    def _append(self, event: Event) -> None:
        if len(self._events) >= self.max_events:
            self._events = [Cleared()]
        self._events.append(event)
        self._lock.notify()


def _extra_keys(lora_name: str | None, salt: str | None) -> tuple[str, ...] | None:
    """vLLM's untagged extra keys of one block: the adapter's name, then the salt."""
    keys = tuple(key for key in (lora_name, salt) if key)
    return keys or None
