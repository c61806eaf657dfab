"""Tool calling over the OpenAI API through the official ``openai`` client: forced calls are
well-formed whatever the random tiny model says, streamed calls accumulate to the
non-streamed answer, conversations with earlier calls render, bad tools are 400s."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from kvgate.engine import AsyncLLM
from kvgate.gateway.function_calls.functions import template_messages
from tests.gateway.live_server import LiveServer
from tests.gateway.mcp.test_tool_runner import run_tool

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "now"}},
]
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
SCHEMAS = {"get_weather": WEATHER, "now": {"type": "object"}}


def create(client: openai.OpenAI, **fields: Any) -> Any:
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=fields.pop("messages", MESSAGES),
        tools=fields.pop("tools", TOOLS),
        max_tokens=fields.pop("max_tokens", 120),
        **fields,
    )


def test_required_calls_validate_over_many_seeds(client: openai.OpenAI) -> None:
    out = create(
        client, tool_choice="required", parallel_tool_calls=False, temperature=1.0, n=8, seed=1
    )
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.message.tool_calls[0].id for c in out.choices}) == 8


def test_a_named_choice_calls_that_function(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = create(client, tool_choice=named, temperature=1.0, n=4, seed=7)
    for choice in out.choices:
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def accumulate(stream: Any) -> tuple[str, list[dict[str, str]], str | None]:
    """What a client builds from ``delta.tool_calls``: id, type and name first, then
    argument fragments, keyed by index."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for part in choice.delta.tool_calls or []:
            if part.index not in calls:
                assert part.id and part.type == "function" and part.function.name
                calls[part.index] = {"id": part.id, "name": part.function.name, "arguments": ""}
            else:
                assert part.id is None and part.function.name is None
            calls[part.index]["arguments"] += part.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    ("tool_choice", "parallel"), [("required", False), ("required", True), ("auto", True)]
)
def test_streamed_calls_add_up_to_the_answer(
    client: openai.OpenAI, tool_choice: str, parallel: bool
) -> None:
    fields = {
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "temperature": 0,
        "max_tokens": 100,
    }
    whole = create(client, **fields).choices[0]
    content, calls, finish = accumulate(create(client, stream=True, **fields))
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in whole.message.tool_calls or []
    ]
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == expected
    assert finish == whole.finish_reason
    assert content.strip() == (whole.message.content or "").strip()
    if tool_choice == "required":
        assert expected and finish in (("tool_calls", "length") if parallel else ("tool_calls",))


def test_auto_with_a_model_that_writes_text_is_content(client: openai.OpenAI) -> None:
    out = create(client, tool_choice="auto", temperature=0, max_tokens=8)
    plain = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=8, temperature=0
    )
    choice = out.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "length"
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools were rendered


def test_none_renders_the_tools_and_never_parses(client: openai.OpenAI) -> None:
    calls = create(client, tool_choice="required", temperature=0, max_tokens=60)
    out = create(client, tool_choice="none", temperature=0, max_tokens=8)
    assert out.usage.prompt_tokens == calls.usage.prompt_tokens
    assert out.choices[0].message.tool_calls is None


def test_parallel_calls_follow_one_another(client: openai.OpenAI) -> None:
    out = create(client, tool_choice="required", temperature=1.0, seed=3, n=6, max_tokens=200)
    assert any(len(c.message.tool_calls) > 1 for c in out.choices)
    for choice in out.choices:
        complete = choice.message.tool_calls
        if choice.finish_reason == "length":  # the last call may be cut short
            complete = complete[:-1]
        for call in complete:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_a_conversation_with_earlier_calls_renders(client: openai.OpenAI, engine: AsyncLLM) -> None:
    call = {
        "id": "chatcmpl-tool-1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "21 C"},
    ]
    out = create(client, messages=messages, max_tokens=2, temperature=0)
    rendered = engine.apply_chat_template(template_messages(messages), tools=TOOLS)
    text = engine.tokenizer.decode(rendered, skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in text
    assert out.usage.prompt_tokens == len(rendered)


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "must be 'function'"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools[0].function.name",
            "letters, digits",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 1}}}]},
            "tools[0].function.parameters",
            "not a valid JSON Schema",
        ),
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope', which is not in 'tools'",
        ),
        ({"tool_choice": "sometimes"}, "tool_choice", "must be 'none', 'auto'"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        ({"functions": [{"name": "f"}]}, "functions", "use 'tools'"),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "already a constraint",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"not": {"type": "string"}}},
                    }
                ],
                "tool_choice": "required",
            },
            None,
            "not supported in constrained decoding",
        ),
    ],
)
def test_bad_tools_are_400s_naming_the_field(
    server: LiveServer, extra: dict[str, Any], param: str | None, message: str
) -> None:
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **extra}
    body = {k: v for k, v in body.items() if v is not None}
    response = httpx.post(server.base + "/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and message in error["message"], error


def test_tools_on_completions_are_refused(server: LiveServer) -> None:
    body = {"prompt": "x", "tools": TOOLS}
    response = httpx.post(server.base + "/v1/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"


def test_the_tool_call_parser_flag_picks_the_syntax(engine: AsyncLLM) -> None:
    """--tool-call-parser mistral: a forced call is written (and read back) in its syntax."""
    with (
        LiveServer(engine, tool_call_parser="mistral") as mistral,
        openai.OpenAI(base_url=mistral.base + "/v1", api_key="unused", max_retries=0) as client,
        httpx.Client(timeout=60) as http,
    ):
        out = create(client, tool_choice="required", parallel_tool_calls=False, temperature=0)
        arguments = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}
        mcp = run_tool(http, mistral, "chat", {**arguments, "max_tokens": 120, "temperature": 0})
    (call,) = out.choices[0].message.tool_calls
    structured = mcp["structuredContent"]
    # Mistral's syntax, read back: its 9-character call ids, the calls out of the content
    assert len(call.id) == 9 and len(structured["tool_calls"][0]["id"]) == 9
    assert structured["text"] == "" and structured["finish_reason"] == "tool_calls"
    assert structured["tool_calls"][0]["function"]["name"] == call.function.name


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_call_cut_inside_its_opening_tag_is_no_content(
    client: openai.OpenAI, tool_choice: Any
) -> None:
    """Two tokens cannot finish ``<tool_call>``: the grammar admits only calls, so the
    fragment is not an answer (it was returned as content), whole or streamed."""
    out = create(client, tool_choice=tool_choice, temperature=0, max_tokens=2)
    (choice,) = out.choices
    assert choice.finish_reason == "length"
    assert not choice.message.content and not choice.message.tool_calls
    chunks = list(create(client, tool_choice=tool_choice, temperature=0, max_tokens=2, stream=True))
    assert not "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_a_call_cut_short_in_the_history_does_not_refuse_the_next_turn(
    client: openai.OpenAI,
) -> None:
    """A forced call cut by max_tokens (arguments '{"a":') is what an agent keeps in its
    history; the next turn is answered (the arguments rendered as {}, as vLLM does), not 400."""

    def unfinished(arguments: str) -> bool:
        try:
            json.loads(arguments)
        except json.JSONDecodeError:
            return bool(arguments)
        return False

    for max_tokens in range(8, 80, 2):  # the first cut inside a call's arguments
        cut = create(client, tool_choice="required", temperature=0, max_tokens=max_tokens)
        calls = cut.choices[0].message.tool_calls or []
        if calls and unfinished(calls[-1].function.arguments):
            break
    assert calls and unfinished(calls[-1].function.arguments), calls
    call = calls[-1]
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "{}"},
    ]
    out = create(client, messages=messages, tool_choice="none", temperature=0, max_tokens=4)
    assert out.choices[0].finish_reason in ("stop", "length")
