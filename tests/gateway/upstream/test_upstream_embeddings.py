"""An upstream's ``/v1/embeddings`` answer is relayed only when it has OpenAI's shape: one
vector of numbers per input, all of one length, each index once (put back in input order),
and a prompt token count; anything else is ``UpstreamFailed`` naming what is wrong."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from kvgate.gateway.calls.errors import UpstreamFailed
from kvgate.gateway.upstream.embeddings import answer_limit, embeddings_of

WHERE = "upstream http://u /v1/embeddings"


def answer(data: Any, usage: Any = None) -> bytes:
    usage = {"prompt_tokens": 7, "total_tokens": 7} if usage is None else usage
    return orjson.dumps({"object": "list", "data": data, "model": "m", "usage": usage})


def item(index: Any, vector: Any) -> dict[str, Any]:
    return {"object": "embedding", "index": index, "embedding": vector}


def test_items_are_put_back_in_input_order() -> None:
    got = embeddings_of(answer([item(1, [0.5, 1]), item(0, [1.0, 0.0])]), 2, WHERE)
    assert got.vectors == [[1.0, 0.0], [0.5, 1.0]] and got.prompt_tokens == 7


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"not json", "not JSON"),
        (orjson.dumps([1, 2]), "'data'"),
        (answer([item(0, [1.0])]), "'data'"),  # one item for two inputs
        (answer([item(0, [1.0]), item(0, [1.0])]), "'index'"),
        (answer([item(0, [1.0]), item(2, [1.0])]), "'index'"),
        (answer([item(0, [1.0]), item(True, [1.0])]), "'index'"),
        (answer([item(0, [1.0]), item(1, [])]), "'embedding'"),
        (answer([item(0, [1.0]), item(1, ["1"])]), "'embedding'"),
        (answer([item(0, [1.0]), item(1, [False])]), "'embedding'"),
        (answer([item(0, [1.0]), item(1, "AACAPw==")]), "'embedding'"),
        (answer([item(0, [1.0]), item(1, [1.0, 2.0])]), "differ in length"),
        (answer([item(0, [1.0]), item(1, [1.0])], usage={}), "prompt_tokens"),
        (answer([item(0, [1.0]), item(1, [1.0])], usage={"prompt_tokens": -1}), "prompt_tokens"),
    ],
)
def test_a_malformed_answer_is_upstream_failed(body: bytes, says: str) -> None:
    with pytest.raises(UpstreamFailed, match=says):
        embeddings_of(body, 2, WHERE)


def test_the_read_bound_grows_with_the_inputs() -> None:
    assert answer_limit(2) - answer_limit(1) == answer_limit(3) - answer_limit(2) > 40_000
