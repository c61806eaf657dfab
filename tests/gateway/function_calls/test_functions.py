"""``tools`` and ``tool_choice`` checks: each bad value names its field."""

from __future__ import annotations

from typing import Any

import pytest

from kvgate.gateway.function_calls.functions import (
    NO_PARAMETERS,
    Functions,
    FunctionsError,
    ToolChoice,
    parse_tool_choice,
    parse_tools,
    template_messages,
)

GOOD = {"type": "function", "function": {"name": "f_1-x", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([], "tools"),
        ({"type": "function"}, "tools"),
        ([{"type": "retrieval"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": "x" * 65}}], "tools[0].function.name"),
        ([GOOD, {"type": "function", "function": {"name": 3}}], "tools[1].function.name"),
        ([GOOD, GOOD], "tools"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "wibble"}}}],
            "tools[0].function.parameters",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tools_name_the_field(tools: Any, param: str) -> None:
    with pytest.raises(FunctionsError) as caught:
        parse_tools(tools)
    assert caught.value.field == param and param.split(".")[0].split("[")[0] in str(caught.value)


def test_parameters_default_to_an_empty_object() -> None:
    functions = parse_tools([{"type": "function", "function": {"name": "now"}}, GOOD])
    assert [f.parameters for f in functions] == [NO_PARAMETERS, {"type": "object"}]


@pytest.mark.parametrize(
    ("raw", "with_tools", "expected"),
    [
        (None, True, ToolChoice("auto")),
        (None, False, ToolChoice("none")),
        ("none", False, ToolChoice("none")),
        ("required", True, ToolChoice("required")),
        ({"type": "function", "function": {"name": "f_1-x"}}, True, ToolChoice("named", "f_1-x")),
    ],
)
def test_tool_choices(raw: Any, with_tools: bool, expected: ToolChoice) -> None:
    assert parse_tool_choice(raw, parse_tools([GOOD]) if with_tools else []) == expected


@pytest.mark.parametrize(
    ("raw", "with_tools", "message"),
    [
        ("required", False, "needs 'tools'"),
        ("always", True, "must be 'none', 'auto', 'required'"),
        ({"type": "function", "function": {"name": "g"}}, True, "'g', which is not in 'tools'"),
        ({"type": "function"}, True, "tool_choice.function.name"),
    ],
)
def test_bad_tool_choices(raw: Any, with_tools: bool, message: str) -> None:
    with pytest.raises(FunctionsError, match=message) as caught:
        parse_tool_choice(raw, parse_tools([GOOD]) if with_tools else [])
    assert caught.value.field == "tool_choice"


def test_earlier_calls_reach_the_template_with_object_arguments() -> None:
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "2"},
    ]
    out = template_messages(messages)
    assert out[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert out[0] is messages[0] and out[2] is messages[2]
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # not mutated
    cut = {**call, "function": {"name": "f", "arguments": '{"a":'}}  # cut short by max_tokens
    out = template_messages([{"role": "assistant", "content": None, "tool_calls": [cut]}])
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {}  # as vLLM: the turn goes on
    deep = {**call, "function": {"name": "f", "arguments": "[" * 100_000}}  # past the stack
    out = template_messages([{"role": "assistant", "content": None, "tool_calls": [deep]}])
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {}


def test_a_tool_request_is_none_without_tools_and_checks_parallel_calls() -> None:
    assert Functions.of(None, None, None) is None
    assert Functions.of(None, "none", False) is None
    request = Functions.of([GOOD], None, None)
    assert request is not None and request.parallel and request.parsed
    assert request.choice == ToolChoice("auto") and request.raw == [GOOD]
    rendered_only = Functions.of([GOOD], "none", False)
    assert rendered_only is not None and not rendered_only.parsed and not rendered_only.parallel
    with pytest.raises(FunctionsError) as caught:
        Functions.of([GOOD], None, "yes")
    assert caught.value.field == "parallel_tool_calls"
