"""Which upstream takes a call: ``engine.router.PrefixRouter`` over the upstreams.

The key is the call's ``cache_key``, else the chained sha256 of its first prefix chunks:
blocks of 16 token ids when the gateway has the model's tokenizer, else fixed 64-character
chunks of the prompt text (a conversation rendered as ``role: content`` lines), the approach
of the Gateway API Inference Extension's prefix scorer. Everything is sha256, so every gateway
process routes a key to the same upstream while none is over its bound. Load is this gateway's
own in-flight calls per upstream, and bounded loads apply once the key's own upstream holds
``AFFINITY_SLACK`` of them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from engine.block_hash import BLOCK_SIZE, block_hashes
from engine.errors import EngineUnavailable
from engine.router import KEY_BLOCKS, PrefixRouter, make_router
from engine.tokenizer import Tokenizer
from gateway.generation import GenerationRequest

CHUNK_CHARS = 64
# A key stays on its own upstream while this gateway has fewer calls than this in flight
# there: an engine server batches a few requests at no cost, and at low concurrency the
# bound ceil(1.25 (total + 1) / n) would be 1 or 2, moving keys off their cache (and, since
# each gateway sees only its own calls, differently in different gateways).
AFFINITY_SLACK = 4
ROOT = hashlib.sha256(b"kvgate-fleet-prefix").digest()


class PrefixKeys:
    """The first ``KEY_BLOCKS`` chained chunk hashes of a request's prompt."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer

    def __call__(self, request: GenerationRequest) -> list[bytes]:
        if isinstance(request.prompt, list):
            return block_hashes(request.prompt[: KEY_BLOCKS * BLOCK_SIZE], ROOT)
        if self.tokenizer is None:
            return _text_hashes(_text(request)[: KEY_BLOCKS * CHUNK_CHARS])
        if request.messages is None:
            assert request.prompt is not None
            ids = self.tokenizer.encode(request.prompt)
        else:
            try:
                ids = self.tokenizer.encode_chat(
                    request.messages,
                    tools=request.tools,
                    chat_template_kwargs=request.chat_template_kwargs,
                )
            except Exception as exc:  # a template may refuse a conversation it cannot format
                raise ValueError(f"messages: the chat template rejected them ({exc})") from exc
        return block_hashes(ids[: KEY_BLOCKS * BLOCK_SIZE], ROOT)


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


class UpstreamRouter:
    """``choose`` → (upstream index, reason): ``key``, ``prefix``, ``overflow`` (the key's own
    upstream was at its load bound), or ``least_loaded`` (no key and no full chunk); the
    baseline policies (``round_robin``, ``random``) give their own name as the reason."""

    def __init__(self, num_upstreams: int, policy: str = "prefix") -> None:
        self.num = num_upstreams
        self.policy = policy
        self._router = make_router(policy, num_upstreams)

    def choose(
        self,
        hashes: Sequence[bytes],
        cache_key: str | None,
        loads: Sequence[int],
        available: Sequence[bool],
    ) -> tuple[int, str]:
        if not any(available):
            raise EngineUnavailable(f"no healthy upstream (all {self.num} are down or excluded)")
        if not isinstance(self._router, PrefixRouter):
            return self._router.choose(hashes, cache_key, 0, loads, available), self.policy
        if cache_key is None and not hashes:
            return self._router.choose(hashes, None, 0, loads, available), "least_loaded"
        # With no load anywhere every upstream has room: that choice is the key's own.
        own = self._router.choose(hashes, cache_key, 0, [0] * self.num, available)
        if loads[own] >= AFFINITY_SLACK:
            pick = self._router.choose(hashes, cache_key, 0, loads, available)
            if pick != own:
                return pick, "overflow"
        return own, "key" if cache_key is not None else "prefix"
