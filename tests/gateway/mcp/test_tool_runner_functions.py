"""``chat`` with ``tools`` over MCP: the official SDK gets parsed ``tool_calls`` in
``structured_content`` (validated by the SDK against the tool's outputSchema); forced choices
are valid calls, ``none`` parses nothing, bad tools are tool errors naming the field."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from mcp import Client

from tests.gateway.live_server import LiveServer
from tests.gateway.mcp.test_tool_runner import output_schema, run_tool

ORDER = {
    "type": "object",
    "properties": {
        "item": {"enum": ["tea", "coffee"]},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["item", "quantity"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "order", "parameters": ORDER}},
    {"type": "function", "function": {"name": "cancel"}},
]
MESSAGES = [{"role": "user", "content": "Tea, please."}]


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as client:
        yield client


async def test_sdk_chat_with_a_required_tool_choice(server: LiveServer) -> None:
    async with Client(server.url) as client:
        listed = {t.name: t for t in (await client.list_tools()).tools}
        assert "tool_choice" in listed["chat"].input_schema["properties"]
        assert "tool_calls" in (listed["chat"].output_schema or {})["properties"]
        for seed in range(6):
            result = await client.call_tool(
                "chat",
                {
                    "messages": MESSAGES,
                    "tools": TOOLS,
                    "tool_choice": "required",
                    "parallel_tool_calls": False,
                    "temperature": 1.0,
                    "seed": seed,
                    "max_tokens": 80,
                },
            )
            assert not result.is_error, result.content
            structured = result.structured_content
            assert structured is not None and structured["finish_reason"] == "tool_calls"
            (call,) = structured["tool_calls"]
            assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
            schema = ORDER if call["function"]["name"] == "order" else {"type": "object"}
            jsonschema.validate(call["function"]["arguments"], schema)
            assert result.content[0].text == structured["text"]


def test_named_choice_and_none(http: httpx.Client, server: LiveServer) -> None:
    named = {"type": "function", "function": {"name": "order"}}
    arguments: dict[str, Any] = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 80}
    result = run_tool(http, server, "chat", {**arguments, "tool_choice": named, "seed": 4})
    structured = result["structuredContent"]
    output_schema(server, "chat").validate(structured)
    (call,) = structured["tool_calls"]
    assert call["function"]["name"] == "order"
    jsonschema.validate(call["function"]["arguments"], ORDER)
    plain = run_tool(http, server, "chat", {**arguments, "tool_choice": "none", "max_tokens": 4})
    assert "tool_calls" not in plain["structuredContent"]
    auto = run_tool(http, server, "chat", {**arguments, "max_tokens": 4, "temperature": 0})
    assert auto["structuredContent"]["tool_calls"] == []  # the tiny model wrote text


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
        ({"tools": None, "tool_choice": "required"}, "'tool_choice' 'required' needs 'tools'"),
        ({"tool_choice": "required", "regex": "a+"}, "already a constraint"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tools_are_tool_errors(
    http: httpx.Client, server: LiveServer, extra: dict[str, Any], message: str
) -> None:
    arguments = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **extra}
    arguments = {k: v for k, v in arguments.items() if v is not None}
    result = run_tool(http, server, "chat", arguments)
    assert result["isError"] is True
    text = result["content"][0]["text"]
    assert text.startswith("Invalid arguments for tool 'chat'") and message in text, text
