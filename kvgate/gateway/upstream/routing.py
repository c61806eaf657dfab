"""Which upstream takes a call: ``kvgate.engine.core.router.PrefixRouter`` over the upstreams.

The key is the call's ``cache_key``, else the chained sha256 of its first prefix chunks:
blocks of 16 token ids when the gateway has the model's tokenizer, else fixed 64-character
chunks of the prompt text (a conversation rendered as ``role: content`` lines), the approach
of the Gateway API Inference Extension's prefix scorer. Everything is sha256, so every gateway
process routes a key to the same upstream while none is over its bound. Load is this gateway's
own in-flight calls per upstream refined by the upstream's scraped queue, batch and KV usage
(``Load``); a key leaves its own upstream only when that one is pressed (a sustained queue, a
full KV cache, or this gateway's own burst there) and over the bounded-load bound. Below that
every gateway routes a key alike, whatever calls each of them happens to have in flight.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.engine.core.block_hash import BLOCK_SIZE, block_hashes
from kvgate.engine.core.router import KEY_BLOCKS, PrefixRouter, make_router
from kvgate.engine.errors import EngineUnavailable
from kvgate.engine.tokenization.tokenizer import Tokenizer
from kvgate.gateway.generation import GenerationRequest

CHUNK_CHARS = 64
# A key stays on its own upstream until that upstream is pressed. An engine server batches
# dozens of requests at no cost (vLLM: 256 by default), so in-flight counts alone say little:
# at low concurrency the bound ceil(1.25 (total + 1) / n) is 2 or 3, and since each gateway
# sees only its own calls, keys moved differently in different gateways (benchmarks/fleet.py
# kept 9 of 12 sessions on one upstream with a slack of 4). Pressure is what the upstream
# reports: requests queued in two scrapes running (a queue within one engine step is
# normal), or its KV cache nearly full; this gateway's own calls there count only as a burst
# guard, for an upstream without metrics or between scrapes.
QUEUE_SLACK = 4
KV_FULL = 0.95
AFFINITY_SLACK = 16
ROOT = hashlib.sha256(b"kvgate-fleet-prefix").digest()


class PrefixKeys:
    """The first ``KEY_BLOCKS`` chained chunk hashes of a request's prompt."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def __call__(self, request: GenerationRequest) -> list[bytes]:
        return self.of(request, self.token_ids(request))

    def of(self, request: GenerationRequest, ids: list[int] | None) -> list[bytes]:
        """The keys of a request whose token ids (None: not known here) are ``ids``."""
        if ids is None:
            return _text_hashes(_text(request)[: KEY_BLOCKS * CHUNK_CHARS])
        return block_hashes(ids[: KEY_BLOCKS * BLOCK_SIZE], ROOT)

    def token_ids(self, request: GenerationRequest) -> list[int] | None:
        """The prompt's token ids: given, or by the tokenizer (None without one)."""
        if isinstance(request.prompt, list):
            return request.prompt
        if self.tokenizer is None:
            return None
        if request.messages is None:
            assert request.prompt is not None
            return self.tokenizer.encode(request.prompt)
        return self.tokenizer.encode_chat(
            request.messages,
            tools=request.template_tools,
            chat_template_kwargs=request.chat_template_kwargs,
        )


def _text(request: GenerationRequest) -> str:
    if request.messages is None:
        assert isinstance(request.prompt, str)
        return request.prompt
    return "".join(f"{m.get('role')}: {m.get('content') or ''}\n" for m in request.messages)


def _text_hashes(text: str) -> list[bytes]:
    hashes: list[bytes] = []
    parent = ROOT
    for start in range(0, len(text) - CHUNK_CHARS + 1, CHUNK_CHARS):
        parent = hashlib.sha256(parent + text[start : start + CHUNK_CHARS].encode()).digest()
        hashes.append(parent)
    return hashes


@dataclass(frozen=True, slots=True)
class Load:
    """What one gateway knows of an upstream's load: its own calls there, live, and what the
    upstream last reported about all of its requests (every gateway's), a few seconds old."""

    in_flight: int  # this gateway's calls there now
    waiting: float = 0.0  # queued upstream, in both of its last two scrapes (the smaller)
    running: float = 0.0  # batched upstream at its last scrape
    kv_usage: float = 0.0  # the fraction of its KV cache held by running requests

    @property
    def pressed(self) -> bool:
        """Would one more call wait or evict there? A sustained queue or a full KV cache
        says so (the same for every gateway: it is the upstream's own figure); this
        gateway's own burst says so before the next scrape can."""
        return (
            self.waiting >= QUEUE_SLACK
            or self.kv_usage >= KV_FULL
            or self.in_flight >= AFFINITY_SLACK
        )

    @property
    def total(self) -> int:
        """Requests there: the upstream's count once scraped (it includes this gateway's as
        of then), this gateway's own when that is larger (newer)."""
        return max(self.in_flight, math.ceil(self.running + self.waiting))


class UpstreamRouter:
    """``choose`` → (member position, reason): ``key``, ``prefix``, ``overflow`` (the key's own
    upstream was pressed and over its load bound), or ``least_loaded`` (no key and no full
    chunk); the baseline policies (``round_robin``, ``random``) give their own name as the
    reason. Members are placed on the ring by name (their URL), so a gateway that lists or
    resolves them in another order routes alike, and one joining or leaving moves only its
    own keys."""

    def __init__(self, names: Sequence[str], policy: str = "prefix") -> None:
        self.num = len(names)
        self.policy = policy
        self._router = make_router(policy, max(1, self.num), names=_ring_names(names))

    def choose(
        self,
        hashes: Sequence[bytes],
        cache_key: str | None,
        loads: Sequence[Load],
        available: Sequence[bool],
    ) -> tuple[int, str]:
        if not any(available):
            raise EngineUnavailable(f"no healthy upstream (all {self.num} are down or excluded)")
        totals = [load.total for load in loads]
        if not isinstance(self._router, PrefixRouter):
            return self._router.choose(hashes, cache_key, 0, totals, available), self.policy
        if cache_key is None and not hashes:
            return self._router.choose(hashes, None, 0, totals, available), "least_loaded"
        # With no load anywhere every upstream has room: that choice is the key's own.
        own = self._router.choose(hashes, cache_key, 0, [0] * self.num, available)
        if loads[own].pressed:
            pick = self._router.choose(hashes, cache_key, 0, totals, available)
            if pick != own:
                return pick, "overflow"
        return own, "key" if cache_key is not None else "prefix"


def _ring_names(names: Sequence[str]) -> list[bytes] | None:
    return [name.encode() for name in names] if names else None
