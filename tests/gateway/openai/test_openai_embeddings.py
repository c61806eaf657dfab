"""``/v1/embeddings`` through the official ``openai`` client against the live gateway over the
shared embedded engine (the tiny model): float and base64 answers are the same vectors, the
vectors are transformers' last-token final hidden state (normalized), a batch of inputs of
different lengths agrees with each input alone, and bad inputs are a 400 naming the field."""

from __future__ import annotations

import base64
import math
import struct

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from kvgate.engine import AsyncLLM
from kvgate.engine.loading.tiny_model import default_model_dir
from tests.engine.test_embeddings import cosine, hf_embedding
from tests.gateway.live_server import LiveServer

TEXTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a small village by the river, there lived an old clockmaker.",
]


def test_float_and_base64_are_the_same_vectors_and_match_transformers(
    client: openai.OpenAI, model: str, engine: AsyncLLM
) -> None:
    floats = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    assert floats.object == "list" and floats.model == model
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert all(d.object == "embedding" for d in floats.data)
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    packed = client.embeddings.create(model=model, input=TEXTS, encoding_format="base64")
    decoded = client.embeddings.create(model=model, input=TEXTS)  # the SDK asks for base64
    reference = AutoModelForCausalLM.from_pretrained(
        default_model_dir(), dtype=torch.float32
    ).eval()
    for prompt, got, raw, default in zip(ids, floats.data, packed.data, decoded.data, strict=True):
        assert isinstance(raw.embedding, str)  # the SDK leaves an explicit base64 as text
        vector = list(struct.unpack(f"<{len(got.embedding)}f", base64.b64decode(raw.embedding)))
        assert vector == got.embedding == pytest.approx(default.embedding, abs=0)
        assert math.isclose(sum(x * x for x in vector), 1.0, rel_tol=1e-4)
        assert cosine(vector, hf_embedding(reference, prompt)) >= 0.999  # a bf16 engine here


def test_a_batch_agrees_with_each_input_alone_and_token_ids_with_text(
    client: openai.OpenAI, model: str, engine: AsyncLLM
) -> None:
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    batch = client.embeddings.create(model=model, input=ids, encoding_format="float")
    assert batch.usage.prompt_tokens == sum(map(len, ids))
    for prompt, text, together in zip(ids, TEXTS, batch.data, strict=True):
        alone = client.embeddings.create(model=model, input=prompt, encoding_format="float")
        by_text = client.embeddings.create(model=model, input=text, encoding_format="float")
        assert len(alone.data) == 1 and alone.usage.prompt_tokens == len(prompt)
        assert cosine(alone.data[0].embedding, together.embedding) >= 0.9999
        assert cosine(by_text.data[0].embedding, together.embedding) >= 0.9999


def test_the_answer_is_exactly_openais_shape(server: LiveServer, model: str) -> None:
    response = httpx.post(
        server.base + "/v1/embeddings",
        json={"input": "Hi", "model": model, "user": "someone"},
        timeout=30,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"object", "data", "model", "usage"}
    assert set(body["data"][0]) == {"object", "index", "embedding"}
    assert set(body["usage"]) == {"prompt_tokens", "total_tokens"}


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"input": ""}, "input", "empty string"),
        ({"input": ["a", ""]}, "input", "empty string"),
        ({"input": []}, "input", "must be a string"),
        ({"input": [[]]}, "input", "none empty"),
        ({"input": {"text": "hi"}}, "input", "must be a string"),
        ({}, "input", "must be a string"),
        ({"input": [10**9]}, "input", "token ids must be in"),
        ({"input": ["hi"] * 2049}, "input", "at most 2048"),
        ({"input": "hi", "dimensions": 8}, "dimensions", "matryoshka"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "one of"),
        ({"input": "hi", "user": 5}, "user", "string"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    server: LiveServer, model: str, fields: dict, param: str, says: str
) -> None:
    response = httpx.post(
        server.base + "/v1/embeddings", json={"model": model, **fields}, timeout=30
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_an_input_may_fill_the_context_but_not_pass_it(
    client: openai.OpenAI, model: str, engine: AsyncLLM
) -> None:
    longest = engine.max_model_len  # nothing is generated after an embedding input
    full = client.embeddings.create(model=model, input=[5] * longest, encoding_format="float")
    assert full.usage.prompt_tokens == longest
    for too_long in ([5] * (longest + 1), ["hi", "hi " * longest]):
        with pytest.raises(openai.BadRequestError) as refused:
            client.embeddings.create(model=model, input=too_long)
        assert refused.value.body["param"] == "input", refused.value.body
        assert f"maximum context length is {longest} tokens" in refused.value.message


def test_an_unknown_model_is_a_404(server: LiveServer) -> None:
    response = httpx.post(
        server.base + "/v1/embeddings", json={"model": "nope", "input": "hi"}, timeout=30
    )
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
