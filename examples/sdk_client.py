"""Call kvgate with the official MCP Python SDK (`pip install mcp==2.3.0`).

`mode="auto"` probes `server/discover` and speaks the stateless 2026-07-28 revision: no
handshake, no session. Tokens stream back as progress notifications while `generate` runs.

    kvgate serve &
    python examples/sdk_client.py [http://127.0.0.1:8000/mcp]
"""

from __future__ import annotations

import asyncio
import sys

from mcp import Client


async def main(url: str) -> None:
    async with Client(url, mode="auto") as client:
        server = client.server_info
        print(
            f"protocol {client.protocol_version}, server {server and server.name} {server and server.version}"
        )
        for tool in (await client.list_tools()).tools:
            print(f"tool {tool.name}: {tool.description}")

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            print(message or "", end="", flush=True)  # the new text; progress = tokens so far

        result = await client.call_tool(
            "generate",
            {"prompt": "Once upon a time", "max_tokens": 32},
            progress_callback=on_progress,
        )
        print(f"\nstructured result: {result.structured_content}")

        bad = await client.call_tool("generate", {"prompt": "hi", "max_tokens": -1})
        print(f"bad arguments -> isError={bad.is_error}: {bad.content[0].text}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/mcp"))
