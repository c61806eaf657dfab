"""FastMCP's client (not the official SDK's own ``Client``) against a live kvgate: it lists the
tools and calls ``generate`` and ``tokenize``. Skipped when fastmcp is absent (it is not in
the dev extra: it brings some twenty packages)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gateway.live_server import LiveServer


async def test_fastmcp_lists_and_calls_the_tools(server: LiveServer) -> None:
    fastmcp: Any = pytest.importorskip("fastmcp")
    async with fastmcp.Client(server.url) as client:
        tools = await client.list_tools()
        assert [tool.name for tool in tools] == ["generate", "chat", "tokenize"]
        generated = await client.call_tool(
            "generate", {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
        )
        counted = await client.call_tool("tokenize", {"text": "Once upon a time"})
    assert not generated.is_error and generated.structured_content["completion_tokens"] > 0
    assert generated.structured_content["text"] == generated.content[0].text
    assert not counted.is_error and counted.structured_content["count"] > 0
