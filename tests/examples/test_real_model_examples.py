"""The README's examples on the real model (SmolLM2-135M-Instruct GGUF, tests/real_model.py)
print text, and tool calling and structured output work on it through both doors: the
OpenAI API (curl, the openai client) and MCP (the official SDK). Not a quality bar: the
answers are non-empty and decode as text; calls and JSON fit their schemas."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import pytest
from mcp import Client
from openai import OpenAI

from kvgate.engine import AsyncLLM, EngineConfig
from tests.examples.test_examples import curl_example, needs_curl, result_of
from tests.gateway.live_server import LiveServer
from tests.real_model import smollm2_file

ORDER = {
    "type": "object",
    "properties": {"item": {"enum": ["tea", "coffee"]}, "quantity": {"type": "integer"}},
    "required": ["item", "quantity"],
    "additionalProperties": False,
}
TEA = [{"role": "user", "content": "Two teas, please."}]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engine = AsyncLLM(EngineConfig(model=str(smollm2_file()), kv_cache_memory="32MiB", seed=0))
    try:
        with LiveServer(engine) as live:
            yield live
    finally:
        engine.shutdown()


def assert_text(text: str) -> None:
    assert text.strip() and "\ufffd" not in text, repr(text)
    assert sum(c.isascii() and c.isalpha() for c in text) >= len(text) // 3, repr(text)


@needs_curl
def test_the_curl_examples_print_text(server: LiveServer) -> None:
    for script in ("generate.sh", "chat.sh"):
        structured = result_of(curl_example(script, server))["structuredContent"]
        assert_text(structured["text"])
    answer = json.loads(curl_example("openai_chat.sh", server))
    assert_text(answer["choices"][0]["message"]["content"])


@needs_curl
def test_openai_door_tool_call(server: LiveServer) -> None:
    choice = json.loads(curl_example("openai_tools.sh", server))["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["unit"] in ("celsius", "fahrenheit")


def test_openai_door_structured_output(server: LiveServer) -> None:
    with OpenAI(base_url=server.base + "/v1", api_key="none") as client:
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=TEA,  # type: ignore[arg-type]
            max_tokens=100,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "order", "schema": ORDER},
            },
        )
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), ORDER)


async def test_mcp_door_tool_call_and_structured_output(server: LiveServer) -> None:
    tools = [{"type": "function", "function": {"name": "order", "parameters": ORDER}}]
    async with Client(server.url) as client:
        called = await client.call_tool(
            "chat",
            {
                "messages": TEA,
                "tools": tools,
                "tool_choice": "required",
                "parallel_tool_calls": False,
                "max_tokens": 100,
            },
        )
        shaped = await client.call_tool(
            "chat", {"messages": TEA, "json_schema": ORDER, "max_tokens": 100}
        )
    assert not called.is_error and not shaped.is_error, (called.content, shaped.content)
    (call,) = (called.structured_content or {})["tool_calls"]
    jsonschema.validate(call["function"]["arguments"], ORDER)
    jsonschema.validate((shaped.structured_content or {})["json"], ORDER)
