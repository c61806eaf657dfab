"""Constrained decoding through the MCP tools: ``json_schema`` / ``regex`` / ``choice`` on
``generate`` and ``chat``, over the official SDK and the live endpoint."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from mcp import Client

from tests.gateway.live_server import LiveServer
from tests.gateway.mcp.test_tool_runner import output_schema, run_tool

ORDER = {
    "type": "object",
    "properties": {
        "item": {"enum": ["tea", "coffee", "cake"]},
        "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["item", "quantity"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as client:
        yield client


async def test_sdk_generate_and_chat_with_a_json_schema(server: LiveServer) -> None:
    messages = [{"role": "user", "content": "Order something."}]
    async with Client(server.url) as client:
        tools = {t.name: t for t in (await client.list_tools()).tools}
        assert "json_schema" in tools["chat"].input_schema["properties"]
        results = [
            await client.call_tool(
                "generate", {"prompt": "Order:", "json_schema": ORDER, "max_tokens": 80, "seed": s}
            )
            for s in range(3)
        ]
        results.append(
            await client.call_tool(
                "chat", {"messages": messages, "json_schema": ORDER, "max_tokens": 80}
            )
        )
    for result in results:
        assert not result.is_error, result.content
        structured = result.structured_content
        assert structured["finish_reason"] == "stop"
        jsonschema.validate(structured["json"], ORDER)
        assert json.loads(result.content[0].text) == structured["json"]


def test_regex_and_choice_and_the_output_schema(http: httpx.Client, server: LiveServer) -> None:
    result = run_tool(http, server, "generate", {"prompt": "Id:", "regex": r"id-[0-9a-f]{4}"})
    assert re.fullmatch(r"id-[0-9a-f]{4}", result["structuredContent"]["text"])
    assert "json" not in result["structuredContent"]
    choices = ["left", "right"]
    result = run_tool(
        http,
        server,
        "chat",
        {"messages": [{"role": "user", "content": "Which way?"}], "choice": choices},
    )
    assert result["structuredContent"]["text"] in choices
    result = run_tool(http, server, "generate", {"prompt": "x", "json_schema": {"type": "boolean"}})
    assert isinstance(result["structuredContent"]["json"], bool)
    output_schema(server, "generate").validate(result["structuredContent"])


@pytest.mark.parametrize(
    ("arguments", "says"),
    [
        ({"json_schema": {"type": "wibble"}, "regex": "a"}, "at most one of"),
        ({"json_schema": {"type": "wibble"}}, "structured_outputs.json"),
        ({"json_schema": {"not": {"type": "null"}}}, "json/not: not supported"),
        ({"regex": "(open"}, "structured_outputs.regex"),
        ({"choice": []}, "choice"),
        ({"json_schema": ORDER, "max_tokens": 2}, "raise max_tokens"),
    ],
)
def test_bad_or_cut_short_constraints_are_tool_errors(
    http: httpx.Client, server: LiveServer, arguments: dict, says: str
) -> None:
    result = run_tool(http, server, "generate", {"prompt": "x", **arguments})
    assert result["isError"] is True
    assert says in result["content"][0]["text"], result["content"][0]["text"]
