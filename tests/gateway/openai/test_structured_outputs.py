"""Structured outputs over the OpenAI API, through the official ``openai`` client: whatever
the random tiny model says, ``response_format`` and vLLM's ``structured_outputs`` hold it."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from kvgate.engine.core.request import GRAMMAR_DEAD_END
from tests.gateway.live_server import LiveServer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog"]}, "maxItems": 2},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a person."}]


def test_chat_json_schema_choices_all_validate(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        max_tokens=120,
        temperature=1.0,
        n=4,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    assert len(out.choices) == 4
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_streamed_json_schema_joins_to_valid_json(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        max_tokens=120,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_opens_an_object(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        max_tokens=8,
        response_format={"type": "json_object"},
    )
    assert out.choices[0].message.content.startswith("{")
    completion = client.completions.create(  # vLLM takes response_format on completions too
        model=client.models.list().data[0].id,
        prompt="JSON:",
        max_tokens=8,
        extra_body={"response_format": {"type": "json_object"}},
    )
    assert completion.choices[0].text.startswith("{")


def test_vllm_structured_outputs_regex_and_choice(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    pattern = r"[A-Z]{3}-\d{3}"
    out = client.completions.create(
        model=model,
        prompt="Code:",
        max_tokens=20,
        n=3,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert all(re.fullmatch(pattern, c.text) for c in out.choices), out.choices
    chat = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["positive", "negative"]}},
    )
    assert chat.choices[0].message.content in ("positive", "negative")


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
            "name",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "not both",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "one of"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "'jsn'"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "wibble"}},
                }
            },
            None,
            "structured_outputs.json",
        ),
        ({"structured_outputs": {"regex": "(open"}}, None, "structured_outputs.regex"),
    ],
)
def test_bad_constraints_are_a_400_naming_them(
    server: LiveServer, extra: dict, param: str | None, message: str
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 4, **extra}
    response = httpx.post(server.base + "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"]


def test_a_grammar_dead_end_stops_and_says_why(server: LiveServer) -> None:
    """Complete after "ok", but min_tokens bans the end the grammar allows: nothing is left."""
    body = {
        "messages": MESSAGES,
        "max_tokens": 8,
        "min_tokens": 5,
        "temperature": 0,
        "structured_outputs": {"choice": ["ok"]},
    }
    response = httpx.post(server.base + "/v1/chat/completions", json=body)
    choice = response.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("ok", "stop")
    assert choice["stop_reason"] == GRAMMAR_DEAD_END
    with httpx.stream(
        "POST", server.base + "/v1/chat/completions", json={**body, "stream": True}
    ) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines() if line[6:7] == "{"]
    assert chunks[-1]["choices"][0]["stop_reason"] == GRAMMAR_DEAD_END
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "ok"
