"""The official MCP Python SDK (mcp==2.3.0) against a live kvgate, stateless and legacy."""

from __future__ import annotations

import pytest
from mcp import Client

from tests.gateway.live_server import LiveServer

MODES = ["auto", "legacy"]


@pytest.mark.parametrize("mode", MODES)
async def test_list_tools(server: LiveServer, mode: str) -> None:
    async with Client(server.url, mode=mode) as client:
        assert client.protocol_version == ("2026-07-28" if mode == "auto" else "2025-11-25")
        assert client.server_info is not None and client.server_info.name == "kvgate"
        tools = (await client.list_tools()).tools
    assert [tool.name for tool in tools] == ["generate", "chat", "tokenize"]
    generate = tools[0]
    assert generate.input_schema["properties"]["cache_key"]["x-mcp-header"] == "Cache-Key"
    assert generate.output_schema is not None


@pytest.mark.parametrize("mode", MODES)
async def test_generate_streams_progress(server: LiveServer, mode: str) -> None:
    updates: list[tuple[float, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        updates.append((progress, message))

    async with Client(server.url, mode=mode) as client:
        result = await client.call_tool(
            "generate",
            {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0},
            progress_callback=on_progress,
        )
    assert not result.is_error
    structured = result.structured_content
    assert structured is not None and structured["completion_tokens"] > 0
    assert updates and [p for p, _ in updates] == sorted({p for p, _ in updates})
    assert "".join(message or "" for _, message in updates) == structured["text"]


@pytest.mark.parametrize("mode", MODES)
async def test_chat_with_cache_key(server: LiveServer, mode: str) -> None:
    messages = [{"role": "user", "content": "Tell me a story."}]
    async with Client(server.url, mode=mode) as client:
        await client.list_tools()  # the SDK mirrors x-mcp-header params from the listed schema
        result = await client.call_tool(
            "chat", {"messages": messages, "max_tokens": 4, "cache_key": "conversation 7 ✓"}
        )
    assert not result.is_error
    assert result.content[0].text == result.structured_content["text"]


@pytest.mark.parametrize("mode", MODES)
async def test_bad_arguments_are_tool_errors(server: LiveServer, mode: str) -> None:
    async with Client(server.url, mode=mode) as client:
        result = await client.call_tool("generate", {"prompt": "hi", "max_tokens": -1})
    assert result.is_error
    assert "max_tokens" in result.content[0].text


async def test_discover_and_resources(server: LiveServer) -> None:
    async with Client(server.url, mode="auto") as client:
        capabilities = client.server_capabilities
        assert capabilities.tools and capabilities.resources and capabilities.prompts
        resources = (await client.list_resources()).resources
        read = await client.read_resource(str(resources[0].uri))
        prompts = (await client.list_prompts()).prompts
    assert read.contents[0].text.startswith("{")
    assert [p.name for p in prompts] == ["summarize"]
