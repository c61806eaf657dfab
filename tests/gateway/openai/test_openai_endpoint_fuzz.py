"""A bounded fuzz run against both OpenAI generation routes: random bodies built from the
fields the API knows, with wrong types and out-of-range values mixed in, and raw bytes. Every
answer is a well-formed success (streamed or not) or an OpenAI error whose status is one the
API documents; never a 500, and the server stays up."""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.gateway.live_server import LiveServer

EXAMPLES = 200
ERROR_STATUSES = {400, 404, 413, 415, 429, 503}
text = st.text(alphabet=string.printable, max_size=20)
anything = st.none() | st.booleans() | st.integers(-3, 40) | st.floats(-3, 3) | text


def maybe(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a value of the right type, sometimes anything at all."""
    return st.integers(0, 19).flatmap(lambda i: anything if i == 7 else value)


messages = st.lists(
    st.fixed_dictionaries(
        {
            "role": maybe(st.sampled_from(["system", "user", "assistant", "tool"])),
            "content": maybe(text)
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text}), max_size=2),
        }
    ),
    min_size=1,
    max_size=3,
)
prompts = text | st.lists(st.integers(0, 500), min_size=1, max_size=5) | st.lists(text, max_size=2)
# Mostly in range; `maybe` and the ranges' ends bring in the wrong types and values.
fields = {
    "model": maybe(st.just("served")),
    "max_tokens": maybe(st.integers(0, 8)),
    "max_completion_tokens": maybe(st.integers(1, 8)),
    "temperature": maybe(st.floats(0, 2.5)),
    "top_p": maybe(st.floats(0.01, 1)),
    "top_k": maybe(st.integers(-1, 50)),
    "n": maybe(st.integers(1, 3)),
    "seed": maybe(st.integers(0, 2**64 - 1)),  # orjson cannot send 2**64
    "stop": maybe(text) | st.lists(text, max_size=3),
    "logprobs": maybe(st.booleans() | st.integers(0, 21)),
    "top_logprobs": maybe(st.integers(0, 21)),
    "echo": maybe(st.booleans()),
    "stream": st.booleans(),
    "stream_options": maybe(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "presence_penalty": maybe(st.floats(-2, 2)),
    "frequency_penalty": maybe(st.floats(-2, 2)),
    "repetition_penalty": maybe(st.floats(0.5, 2)),
    "min_tokens": maybe(st.integers(0, 4)),
    "ignore_eos": maybe(st.booleans()),
    "cache_key": maybe(text),
    "cache_salt": maybe(text),
    "user": maybe(text),
    "tools": st.none()
    | st.lists(
        st.sampled_from(
            [
                {"type": "function"},
                {"type": "function", "function": {"name": "f"}},
                {"type": "function", "function": {"name": "g", "parameters": {"type": "nope"}}},
                {
                    "type": "function",
                    "function": {"name": "h", "parameters": {"properties": {"a": {"enum": [1]}}}},
                },
            ]
        ),
        max_size=2,
    ),
    "tool_choice": maybe(
        st.sampled_from(
            ["none", "auto", "required", "nah", {"type": "function", "function": {"name": "f"}}]
            + [{"type": "function", "function": {"name": "zz"}}, {"type": "function"}]
        )
    ),
    "parallel_tool_calls": maybe(st.booleans()),
    "response_format": maybe(
        st.sampled_from(
            [
                {"type": "text"},
                {"type": "json_object"},
                {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": {"type": "integer"}},
                },
                {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "nope"}}},
                {"type": "json_schema"},
            ]
        )
    ),
    "structured_outputs": maybe(
        st.sampled_from(
            [{"regex": "[a-c]{1,3}"}, {"choice": ["a", "b"]}, {"json": {"type": "boolean"}}]
            + [{"regex": "("}, {}, {"grammar": "root ::= x"}]
        )
    ),
}
bodies = st.fixed_dictionaries({"prompt": maybe(prompts), "messages": maybe(messages)}).flatmap(
    lambda required: st.fixed_dictionaries({}, optional=dict(list(fields.items()))).map(
        lambda optional: {**required, **optional}
    )
)


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as client:
        yield client


def check_stream(response: httpx.Response) -> None:
    lines = [line for line in response.text.splitlines() if line]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    for line in lines[:-1]:
        chunk = orjson.loads(line.removeprefix("data: "))
        assert "error" in chunk or {"id", "object", "choices"} <= set(chunk)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    body=bodies,
    raw=st.integers(0, 19).flatmap(lambda i: st.binary(max_size=60) if i == 7 else st.none()),
)
def test_every_answer_is_well_formed(
    http: httpx.Client, server: LiveServer, route: str, body: dict[str, Any], raw: bytes | None
) -> None:
    if body.get("model") == "served":
        body["model"] = server.app.state.openai.model
    content = raw if raw is not None else json.dumps(body).encode()  # any integer size
    response = http.post(
        server.base + route, content=content, headers={"content-type": "application/json"}
    )
    event(f"HTTP {response.status_code}")
    assert response.status_code != 500, response.text
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            check_stream(response)
        else:
            answer = response.json()
            assert answer["choices"] and answer["usage"]["total_tokens"] >= 0
        return
    assert response.status_code in ERROR_STATUSES, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


def test_the_server_is_still_up(http: httpx.Client, server: LiveServer) -> None:
    assert http.get(server.base + "/v1/models").status_code == 200
