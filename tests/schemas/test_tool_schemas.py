"""schemas/tools.py: the tool definitions are valid MCP Tools on both wires."""

import pytest
from jsonschema import Draft202012Validator

from protocol.headers import HeaderParam, header_params
from schemas.mcp_wire import LEGACY_WIRE, MODERN_WIRE, validator
from schemas.tools import CACHE_KEY_HEADER, inference_tools

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
