"""kvgate/schemas/tools.py: the tool definitions are valid MCP Tools on both wires."""

import pytest
from jsonschema import Draft202012Validator

from kvgate.protocol.headers import HeaderParam, header_params
from kvgate.schemas.mcp_wire import LEGACY_WIRE, MODERN_WIRE, validator
from kvgate.schemas.tools import CACHE_KEY_HEADER, inference_tools

TOOLS = inference_tools("tiny", 2048)


@pytest.mark.parametrize("wire", [MODERN_WIRE, LEGACY_WIRE])
def test_definitions_are_valid_tools(wire: str) -> None:
    for tool in TOOLS:
        validator(wire, "Tool").validate(tool)
        Draft202012Validator.check_schema(tool["inputSchema"])
        Draft202012Validator.check_schema(tool["outputSchema"])


def test_order_and_context_bound() -> None:
    assert [t["name"] for t in TOOLS] == ["generate", "chat", "tokenize"]
    assert TOOLS[0]["inputSchema"]["properties"]["max_tokens"]["maximum"] == 2048


def test_cache_key_is_mirrored_into_a_header() -> None:
    for tool in TOOLS[:2]:
        assert header_params(tool["inputSchema"]) == (
            HeaderParam(("cache_key",), CACHE_KEY_HEADER, "string"),
        )
    assert header_params(TOOLS[2]["inputSchema"]) == ()


def test_chat_accepts_tool_turns_and_tools() -> None:
    """What agents send: tools, an assistant turn of tool calls (content null), the tool's
    answer, text parts, template variables."""
    from kvgate.schemas.validation import ArgumentValidator

    chat = next(t for t in TOOLS if t["name"] == "chat")
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    arguments = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "2"},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "chat_template_kwargs": {"enable_thinking": False},
    }
    validator = ArgumentValidator("chat", chat["inputSchema"])
    assert validator.problems(arguments) == []
    bad = {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]}]}
    assert validator.problems(bad) == [
        "messages[0].tool_calls[0]: 'function' is a required property"
    ]
