"""``/v1/embeddings``: the OpenAI body → an ``EmbeddingsRequest``, and the answer in OpenAI's
shape (``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
"usage"}``).

``input`` is a string, a list of strings, token ids or a list of token-id lists (at most
``MAX_INPUTS``, none empty, as OpenAI refuses an empty string); ``encoding_format`` ``float``
(the default) or ``base64`` (little-endian float32 bytes, as OpenAI sends them);
``dimensions`` is refused, as vLLM refuses it for a model without Matryoshka training
(shortening these vectors would only lose quality); ``user`` is accepted; vLLM's
``cache_salt`` splits the tenant's prefix cache further, as on the other routes. The vectors are the
engine's: last-token pooling of the final normalized hidden state, L2-normalized.
"""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Any

import orjson

from kvgate.gateway.calls.errors import BadInput
from kvgate.gateway.generation import Adapter, Embeddings, EmbeddingsRequest
from kvgate.gateway.openai import requests as parse

MAX_INPUTS = 2048  # OpenAI's limit on one call's inputs
ENCODINGS = ("float", "base64")


@dataclass(frozen=True)
class EmbeddingsCall:
    request: EmbeddingsRequest
    encoding: str  # "float" or "base64"


def read(body: dict[str, Any], model: str, adapters: list[Adapter] | None) -> EmbeddingsCall:
    """The body's fields, checked (BadInput naming the field). The base model embeds; a LoRA
    adapter's ``model`` is refused (404 for a name not served at all)."""
    adapter = parse.check_model(body, model, adapters)
    if adapter is not None:
        raise BadInput(
            f"embeddings are served by the base model '{model}', not the adapter '{adapter}'",
            "model",
        )
    inputs = parse.completion_prompts(body, "input")
    if len(inputs) > MAX_INPUTS:
        raise BadInput(f"'input' must have at most {MAX_INPUTS} items, got {len(inputs)}", "input")
    if any(i == "" for i in inputs):
        raise BadInput("'input' must not contain an empty string", "input")
    encoding = body.get("encoding_format")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODINGS:
        raise BadInput(
            f"'encoding_format' must be one of {list(ENCODINGS)}, got {encoding!r}",
            "encoding_format",
        )
    if body.get("dimensions") is not None:
        raise BadInput(
            f'Model "{model}" does not support matryoshka representation, changing output '
            "dimensions will lead to poor results.",
            "dimensions",
        )
    for name in ("user", "cache_salt"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise BadInput(f"'{name}' must be a string", name)
    return EmbeddingsCall(EmbeddingsRequest(inputs, body.get("cache_salt")), encoding)


def answer(result: Embeddings, model: str, encoding: str) -> dict[str, Any]:
    """OpenAI's embeddings response."""
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(vector, encoding)}
        for i, vector in enumerate(result.vectors)
    ]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def encoded_answer(result: Embeddings, model: str, encoding: str) -> bytes:
    """``answer`` as JSON bytes (a large one is built on a worker)."""
    return orjson.dumps(answer(result, model, encoding))


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
