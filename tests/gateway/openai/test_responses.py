"""``/v1/responses`` through the official ``openai`` client: whole and streamed answers (the
events validated against the SDK's own types, their deltas joined to the whole text), a
forced function call whose arguments validate against its parameters, the call and its
output on the next turn, ``text.format``, a reply cut by ``max_output_tokens``, and the
stateless refusals of ``store`` / ``previous_response_id``."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.gateway.live_server import LiveServer
from tests.gateway.openai.test_tool_calls import WEATHER

TOOLS: list[Any] = [
    {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER},
    {"type": "function", "name": "now", "parameters": None, "strict": False},
]
EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def streamed(client: openai.OpenAI, **fields: Any) -> tuple[list[Any], Response]:
    """Every event of a streamed response, each validated by the SDK's types, and the
    final Response."""
    with client.responses.create(stream=True, **fields) as stream:
        events = [EVENTS.validate_python(e.model_dump()) for e in stream]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[1].type == "response.in_progress"
    assert events[-1].type in ("response.completed", "response.incomplete")
    return events, events[-1].response


def test_whole_and_streamed_answers_agree(client: openai.OpenAI, model: str) -> None:
    fields = {"model": model, "input": "Say hi", "instructions": "Be brief.", "temperature": 0}
    whole = client.responses.create(max_output_tokens=24, **fields)  # type: ignore[call-overload]
    Response.model_validate(whole.model_dump())
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    (message,) = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert whole.output_text and whole.instructions == "Be brief."
    usage = whole.usage
    assert usage is not None and usage.output_tokens <= 24
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0

    events, final = streamed(client, max_output_tokens=24, **fields)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert deltas == done.text == final.output_text == whole.output_text  # greedy: the same
    kinds = [e.type for e in events]
    assert kinds[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]


def test_a_reply_cut_by_max_output_tokens_is_incomplete(client: openai.OpenAI, model: str) -> None:
    eos = {"ignore_eos": True}  # a vLLM extra: the tiny model may end before 3 tokens
    out = client.responses.create(
        model=model, input="Count", max_output_tokens=3, temperature=0, extra_body=eos
    )
    assert out.status == "incomplete"
    assert out.incomplete_details is not None
    assert out.incomplete_details.reason == "max_output_tokens"
    events, final = streamed(
        client, model=model, input="Count", max_output_tokens=3, extra_body=eos
    )
    assert events[-1].type == "response.incomplete" and final.status == "incomplete"


def test_a_forced_call_validates_and_continues_next_turn(client: openai.OpenAI, model: str) -> None:
    choice = {"type": "function", "name": "get_weather"}
    out = client.responses.create(
        model=model, input="Weather in Paris?", tools=TOOLS, tool_choice=choice,
        max_output_tokens=120, temperature=1.0,
    )  # fmt: skip
    (call,) = [i for i in out.output if i.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)

    events, final = streamed(
        client, model=model, input="Weather?", tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_output_tokens=120, temperature=1.0,
    )  # fmt: skip
    (streamed_call,) = [i for i in final.output if i.type == "function_call"]
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == done.arguments == streamed_call.arguments

    turn = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"},
    ]  # fmt: skip
    after = client.responses.create(
        model=model,
        input=turn,
        tools=TOOLS,
        tool_choice="none",
        max_output_tokens=8,  # type: ignore[arg-type]
    )
    assert after.output[0].type == "message"

    cut = [*turn[:1], {**turn[1], "arguments": '{"city":'}, turn[2]]  # cut by max tokens
    after = client.responses.create(model=model, input=cut, max_output_tokens=4)  # type: ignore[arg-type]
    assert after.status in ("completed", "incomplete")  # served: the call renders as {}


def test_text_format_json_schema_is_held(client: openai.OpenAI, model: str) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    text = {"format": {"type": "json_schema", "name": "digit", "schema": schema, "strict": True}}
    out = client.responses.create(model=model, input="A digit", text=text, max_output_tokens=40)  # type: ignore[arg-type]
    jsonschema.validate(json.loads(out.output_text), schema)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": 3}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
    ],
)
def test_bad_or_stateful_requests_are_400s_naming_the_field(
    server: LiveServer, fields: dict[str, Any], param: str
) -> None:
    body = {"input": "hi", **fields}
    response = httpx.post(server.base + "/v1/responses", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    if param in ("store", "previous_response_id"):
        assert "--redis-url" in response.json()["error"]["message"]


def test_store_absent_or_false_is_served_without_redis(client: openai.OpenAI, model: str) -> None:
    out = client.responses.create(model=model, input="hi", store=False, max_output_tokens=2)
    assert out.store is False
