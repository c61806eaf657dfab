"""The reasoning split in the call path: the thinking read before the calls (a call written
while thinking is thinking, not a call), and structured outputs held only after the thinking
— every kind of them still compiles as xgrammar's structural tag."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import xgrammar as xgr

from kvgate.engine.sampling_params import SamplingParams, StructuredOutputs
from kvgate.gateway.function_calls.formats import HERMES
from kvgate.gateway.function_calls.functions import Functions
from kvgate.gateway.function_calls.reading import FunctionCalling
from kvgate.gateway.generation import Completion, TextDelta
from kvgate.gateway.reasoning.parser import DEEPSEEK_R1, QWEN3, ReasoningFormat
from kvgate.gateway.reasoning.reading import Reasoning

REPLY = (
    '<think>maybe <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> no</think>'
    'Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
)
TOOLS = [{"type": "function", "function": {"name": "f"}}]


async def replay(text: str, size: int) -> AsyncIterator[TextDelta | Completion]:
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for n, piece in enumerate(pieces, 1):
        yield TextDelta(piece, n, [n], None)
    yield Completion(text, "stop", 3, len(pieces), 0, 0)


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
async def test_calls_are_read_from_what_follows_the_thinking(size: int) -> None:
    functions = Functions.of(TOOLS, "auto", None)
    assert functions is not None
    calling = FunctionCalling(functions, HERMES)
    items = [i async for i in calling.read(Reasoning(QWEN3).read(replay(REPLY, size)))]
    done = items[-1]
    assert isinstance(done, Completion)
    assert done.reasoning == 'maybe <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call> no'
    assert done.text == "Sure."
    assert done.tool_calls is not None and [c.arguments for c in done.tool_calls] == ['{"a": 1}']
    assert done.finish_reason == "tool_calls"
    deltas = [i for i in items if isinstance(i, TextDelta)]
    assert "".join(d.reasoning for d in deltas) == done.reasoning
    assert "".join(d.text for d in deltas) == "Sure."


KINDS: list[dict[str, Any]] = [
    {"json": {"type": "object", "properties": {"n": {"type": "integer"}}}},
    {"json_object": True},
    {"regex": "[a-z]{2,4}"},
    {"choice": ["yes", "no \"quoted\""]},
    {"grammar": 'root ::= "a" | "b"'},
    {"structural_tag": HERMES.structural_tag(Functions.of(TOOLS, "required", None).functions,  # type: ignore[union-attr]
                                             Functions.of(TOOLS, "required", None).choice, False)},  # type: ignore[union-attr]
]  # fmt: skip


@pytest.mark.parametrize("form", [QWEN3, DEEPSEEK_R1])
@pytest.mark.parametrize("spec", KINDS)
def test_every_structured_output_is_held_after_the_thinking(
    form: ReasoningFormat, spec: dict[str, Any]
) -> None:
    params = SamplingParams(structured_outputs=StructuredOutputs.from_dict(spec))
    held = Reasoning(form).constrain(params).structured_outputs
    assert held is not None and held.kind == "structural_tag"
    tag = held.value
    assert isinstance(tag, dict)
    grammar = xgr.Grammar.from_structural_tag(json.dumps(tag))
    assert "</think>" in str(grammar)
    thinking = tag["format"] if form.opened_by_template else tag["format"]["elements"][0]
    assert thinking["elements"][0]["end"] == "</think>"


def test_without_a_structured_output_nothing_is_added() -> None:
    params = SamplingParams(max_tokens=3)
    assert Reasoning(QWEN3).constrain(params) is params


@pytest.mark.parametrize("form", [QWEN3, DEEPSEEK_R1])
def test_choices_past_the_bmp_reach_the_grammar_as_themselves(form: ReasoningFormat) -> None:
    spec = StructuredOutputs(choice=["😀 ok", "𝄞"])
    held = Reasoning(form).constrain(SamplingParams(structured_outputs=spec)).structured_outputs
    assert held is not None
    grammar = str(xgr.Grammar.from_structural_tag(json.dumps(held.value)))
    assert "\\U0001f600 ok" in grammar and "\\U0001d11e" in grammar
    assert "\\ud83d" not in grammar  # no lone surrogate: no UTF-8 text holds one
