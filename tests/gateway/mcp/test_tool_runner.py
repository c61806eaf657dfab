"""The inference tools over the live endpoint, checked against the engine itself."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from jsonschema import Draft202012Validator

from kvgate.engine import AsyncLLM, SamplingParams
from kvgate.gateway.mcp.tool_runner import model_json
from kvgate.protocol import jsonrpc
from tests.gateway.live_server import LiveServer
from tests.gateway.wire import call


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as client:
        yield client


def run_tool(
    http: httpx.Client,
    server: LiveServer,
    tool: str,
    arguments: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    exchange = call(
        http,
        server.url,
        "tools/call",
        {"name": tool, "arguments": arguments},
        name=tool,
        headers=headers,
    )
    assert exchange.status == 200
    return exchange.result


def output_schema(server: LiveServer, tool: str) -> Draft202012Validator:
    definition = next(t for t in server.app.state.served.current.tools if t["name"] == tool)
    return Draft202012Validator(definition["outputSchema"])


async def engine_text(engine: AsyncLLM, prompt: str | list[int], max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    text = ""
    async for out in engine.generate(prompt, params):
        text = out.text
    return text


def test_generate_matches_the_engine(
    http: httpx.Client, server: LiveServer, engine: AsyncLLM
) -> None:
    result = run_tool(
        http, server, "generate", {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    )
    structured = result["structuredContent"]
    output_schema(server, "generate").validate(structured)
    assert result["isError"] is False
    assert result["content"] == [{"type": "text", "text": structured["text"]}]
    assert structured["text"] == asyncio.run(engine_text(engine, "Once upon a time", 6))
    assert structured["prompt_tokens"] == len(engine.tokenizer.encode("Once upon a time"))
    assert 0 < structured["completion_tokens"] <= 6
    if structured["finish_reason"] == "length":
        assert structured["completion_tokens"] == 6
    assert structured["model"] == engine.model_name


def test_chat_uses_the_chat_template(
    http: httpx.Client, server: LiveServer, engine: AsyncLLM
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    result = run_tool(
        http, server, "chat", {"messages": messages, "max_tokens": 5, "temperature": 0}
    )
    structured = result["structuredContent"]
    output_schema(server, "chat").validate(structured)
    prompt_ids = engine.apply_chat_template(messages)
    assert structured["prompt_tokens"] == len(prompt_ids)
    assert structured["text"] == asyncio.run(engine_text(engine, prompt_ids, 5))


def test_chat_passes_tools_to_the_chat_template(
    http: httpx.Client, server: LiveServer, engine: AsyncLLM
) -> None:
    messages = [{"role": "user", "content": "What is the weather?"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    arguments = {"messages": messages, "tools": tools, "max_tokens": 3, "temperature": 0}
    structured = run_tool(http, server, "chat", arguments)["structuredContent"]
    with_tools = engine.apply_chat_template(messages, tools=tools)
    assert len(with_tools) > len(engine.apply_chat_template(messages))
    assert structured["prompt_tokens"] == len(with_tools)
    assert structured["text"] == asyncio.run(engine_text(engine, with_tools, 3))


def test_tokenize_is_the_engine_tokenizer(
    http: httpx.Client, server: LiveServer, engine: AsyncLLM
) -> None:
    structured = run_tool(http, server, "tokenize", {"text": "hello world"})["structuredContent"]
    assert structured["token_ids"] == engine.tokenizer.encode("hello world")
    assert structured["count"] == len(structured["token_ids"])
    output_schema(server, "tokenize").validate(structured)


def test_shared_cache_key_reuses_the_prefix(http: httpx.Client, server: LiveServer) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 12
    args = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "cache_key": "tenant-a"}
    headers = {"Mcp-Param-Cache-Key": "tenant-a"}
    run_tool(http, server, "generate", args, headers)
    again = run_tool(http, server, "generate", args, headers)["structuredContent"]
    assert again["cached_tokens"] >= 16  # at least one full block came from the cache


def test_prompt_that_does_not_fit_is_a_tool_error(
    http: httpx.Client, server: LiveServer, engine: AsyncLLM
) -> None:
    prompt = "word " * (engine.max_model_len + 10)
    result = run_tool(http, server, "generate", {"prompt": prompt, "max_tokens": 1})
    assert result["isError"] is True
    text = result["content"][0]["text"]
    assert text.startswith("Invalid arguments for tool 'generate'") and "prompt" in text
    assert engine.stats().num_running == 0


def test_a_prompt_near_the_context_without_max_tokens_stops_at_the_context(
    http: httpx.Client, server: LiveServer, engine: AsyncLLM
) -> None:
    """The tool's max_tokens of 64 is a default, not the caller's: a prompt that leaves less
    room generates to the context's end (asked for, 64 past the context is a tool error)."""
    ids = engine.tokenizer.encode("word " * engine.max_model_len)[: engine.max_model_len - 8]
    prompt = engine.tokenizer.decode(ids)
    room = engine.max_model_len - len(engine.tokenizer.encode(prompt))
    assert 0 < room < 64
    result = run_tool(http, server, "generate", {"prompt": prompt, "temperature": 0})
    assert result["isError"] is False, result
    assert result["structuredContent"]["completion_tokens"] <= room
    asked = run_tool(http, server, "generate", {"prompt": prompt, "max_tokens": 64})
    assert asked["isError"] is True and "max_tokens" in asked["content"][0]["text"]


def test_bad_chat_messages_are_a_tool_error(http: httpx.Client, server: LiveServer) -> None:
    result = run_tool(http, server, "chat", {"messages": [{"role": "user"}], "max_tokens": 1})
    assert result["isError"] is True
    assert "messages[0]: 'content' is a required property" in result["content"][0]["text"]


def test_a_replys_json_with_an_integer_past_64_bits_still_encodes() -> None:
    """A real model answered a JSON Schema with a 30-digit integer: the answer's encoding
    failed (-32603). It is carried as a float; 64-bit integers stay exact."""
    value = model_json('{"id": 123456789012345678901234567890, "n": 18446744073709551615}')
    assert value == {"id": 1.2345678901234568e29, "n": 2**64 - 1}
    assert isinstance(value["n"], int)
    body = jsonrpc.encode_result(1, {"structuredContent": {"json": value}})
    assert orjson.loads(body)["result"]["structuredContent"]["json"] == value
    assert model_json("[-9223372036854775808, " + "9" * 5000 + "]") == [-(2**63), float("inf")]
