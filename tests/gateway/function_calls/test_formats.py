"""Which family a chat template speaks, and the grammar that forces a call: on the random
tiny model at temperature 1, over many seeds, every reply of every family is a call in that
family's syntax whose arguments validate against the tool's parameters."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from kvgate.engine import AsyncLLM, SamplingParams
from kvgate.engine.tokenization.chat_template import render
from kvgate.gateway.function_calls.formats import (
    FAMILIES,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    Family,
    resolve,
)
from kvgate.gateway.function_calls.functions import (
    Functions,
    ToolChoice,
    parse_tools,
    template_messages,
)
from kvgate.gateway.function_calls.parser import parse

TEMPLATES = Path(__file__).parents[2] / "engine" / "tokenization" / "chat_templates"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "filters": {
            "type": "object",
            "properties": {"max": {"type": "number", "minimum": 0, "maximum": 10}},
            "required": ["max"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
    },
    "required": ["query", "filters", "tags"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH}},
    {"type": "function", "function": {"name": "now"}},
]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH, "now": {"type": "object"}}
SEEDS = 24


@pytest.mark.parametrize(
    ("template", "family"),
    [
        ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", HERMES),
        ("Qwen-Qwen2.5-7B-Instruct.jinja", HERMES),
        ("Qwen-Qwen3-0.6B.jinja", HERMES),
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", LLAMA3_JSON),
        ("meta-llama-Llama-3.2-3B-Instruct.jinja", LLAMA3_JSON),
        ("mistralai-Mistral-Nemo-Instruct-2407.jinja", MISTRAL),
        ("google-gemma-2-2b-it.jinja", HERMES),  # names no syntax: the default
    ],
)
def test_the_family_comes_from_the_template(template: str, family: Family) -> None:
    assert resolve(None, (TEMPLATES / template).read_text()) is family


def test_the_flag_wins_and_an_unknown_name_is_refused() -> None:
    llama = (TEMPLATES / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
    assert resolve("mistral", llama) is MISTRAL
    assert resolve(None, {"default": "plain", "tool_use": llama}) is LLAMA3_JSON
    assert resolve(None, None) is HERMES
    with pytest.raises(ValueError, match="--tool-call-parser: unknown parser 'qwen'"):
        resolve("qwen", llama)


async def _replies(engine: AsyncLLM, params: SamplingParams, n: int) -> list[tuple[str, str]]:
    async def one(seed: int) -> tuple[str, str]:
        text, reason = "", ""
        async for out in engine.generate("Use a tool.", replace(params, seed=seed)):
            text, reason = out.text, out.finish_reason or ""
        return text, reason

    return list(await asyncio.gather(*(one(seed) for seed in range(n))))


@pytest.mark.parametrize("family", FAMILIES.values(), ids=list(FAMILIES))
@pytest.mark.parametrize(
    ("choice", "parallel"),
    [(ToolChoice("required"), False), (ToolChoice("named", "search"), True)],
    ids=["required", "named"],
)
def test_forced_choices_always_yield_valid_calls(
    engine: AsyncLLM, family: Family, choice: ToolChoice, parallel: bool
) -> None:
    constraint = family.constraint(Functions(TOOLS, parse_tools(TOOLS), choice, parallel))
    params = SamplingParams(temperature=1.0, max_tokens=400, structured_outputs=constraint)
    names = set()
    for text, reason in asyncio.run(_replies(engine, params, SEEDS)):
        assert reason == "stop", text
        parsed = parse(family, text)
        assert parsed.content is None and len(parsed.calls) == 1, text
        call = parsed.calls[0]
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        names.add(call.name)
    assert names == ({"search"} if choice.name else set(SCHEMAS))  # each tool drawn


def test_required_with_parallel_calls_writes_well_formed_calls(engine: AsyncLLM) -> None:
    """Several calls may follow one another; a random model may run out of max_tokens in the
    last, but every call before it is complete and valid."""
    tools = Functions.of(TOOLS, "required", True)
    assert tools is not None
    constraint = HERMES.constraint(tools)
    params = SamplingParams(temperature=1.0, max_tokens=160, structured_outputs=constraint)
    for text, reason in asyncio.run(_replies(engine, params, SEEDS)):
        calls = parse(HERMES, text).calls
        complete = calls if reason == "stop" else calls[:-1]
        assert calls and (reason == "stop" or reason == "length")
        for call in complete:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize(
    ("template", "family"),
    [
        ("mistralai-Mistral-Nemo-Instruct-2407.jinja", MISTRAL),
        ("Qwen-Qwen2.5-7B-Instruct.jinja", HERMES),
        ("meta-llama-Llama-3.1-8B-Instruct.jinja", LLAMA3_JSON),
    ],
)
def test_a_parsed_call_renders_back_through_its_template(template: str, family: Family) -> None:
    """The calls a reply made go back as the next turn's history: the family's own template
    takes them (Mistral's insists on 9-character ids)."""
    reply = {
        HERMES: '<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call>',
        LLAMA3_JSON: '{"name": "now", "parameters": {"tz": "UTC"}}',
        MISTRAL: '[TOOL_CALLS][{"name": "now", "arguments": {"tz": "UTC"}}]',
    }[family]
    (call,) = parse(family, reply).calls
    history = [
        {"role": "user", "content": "Time?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "12:00"},
    ]
    text = render(
        (TEMPLATES / template).read_text(),
        template_messages(history),
        add_generation_prompt=True,
        tools=TOOLS,
        special_tokens={"bos_token": "<s>", "eos_token": "</s>"},
    )
    assert '"tz": "UTC"' in text and "12:00" in text
