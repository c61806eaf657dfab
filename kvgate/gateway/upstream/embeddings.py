"""An upstream's ``/v1/embeddings`` answer, read within a bound and checked before it is
relayed: one vector of numbers per input, all of one length, each index once, and a prompt
token count (``UpstreamFailed`` for anything else: what an upstream writes never reaches a
client unchecked)."""

from __future__ import annotations

from typing import Any

import orjson

from kvgate.gateway.calls.errors import UpstreamFailed
from kvgate.gateway.generation import Embeddings

# An answer is read up to this many bytes per input (a vector of ~10,000 floats as JSON text)
# plus a fixed allowance.
BYTES_PER_INPUT = 256 << 10
MIN_BYTES = 1 << 16


def answer_limit(inputs: int) -> int:
    return MIN_BYTES + BYTES_PER_INPUT * inputs


def embeddings_of(answer: bytes, count: int, where: str) -> Embeddings:
    """The vectors in input order and the prompt tokens of an OpenAI embeddings answer."""
    try:
        body = orjson.loads(answer)
    except orjson.JSONDecodeError:
        raise UpstreamFailed(f"{where}: its answer is not JSON: {answer[:200]!r}") from None
    data = body.get("data") if isinstance(body, dict) else None
    usage = body.get("usage") if isinstance(body, dict) else None
    if not (isinstance(data, list) and len(data) == count):
        raise UpstreamFailed(f"{where}: malformed answer: 'data' is not one item per input")
    vectors: list[list[float] | None] = [None] * count
    for item in data:
        index, vector = _item(item)
        if index is None or not 0 <= index < count or vectors[index] is not None:
            raise UpstreamFailed(f"{where}: malformed answer: an item's 'index' is wrong")
        if vector is None:
            raise UpstreamFailed(f"{where}: malformed answer: an item's 'embedding' is wrong")
        vectors[index] = vector
    tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0):
        raise UpstreamFailed(f"{where}: malformed answer: 'usage.prompt_tokens' is wrong")
    lengths = {len(v) for v in vectors if v is not None}
    if len(lengths) != 1:
        raise UpstreamFailed(f"{where}: malformed answer: the vectors differ in length")
    return Embeddings([v for v in vectors if v is not None], tokens)


def _item(item: Any) -> tuple[int | None, list[float] | None]:
    """An item's index and its vector (None for either that is not what OpenAI sends)."""
    if not isinstance(item, dict):
        return None, None
    index, vector = item.get("index"), item.get("embedding")
    if not isinstance(index, int) or isinstance(index, bool):
        index = None
    if not isinstance(vector, list) or not vector:
        return index, None
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in vector):
        return index, None
    return index, [float(x) for x in vector]
