"""The two servers kvgate is measured against, each under the same uvicorn settings.

- `sdk`: the official `mcp` SDK's `MCPServer` with one `echo` tool, stateless Streamable HTTP
  with JSON responses — what a developer gets by following the SDK's documentation.
- `bare`: a Starlette route answering every POST with fixed bytes (the bytes kvgate answers a
  given method with): no parsing, no validation, so the practical ceiling of this HTTP stack.

    python -m benchmarks.baselines sdk --port 8001
    python -m benchmarks.baselines bare --port 8002 --bodies bodies.json
"""

from __future__ import annotations

import argparse
import gc
import json
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

# One uvicorn worker with uvloop and httptools, no access log: used for every target.
UVICORN_SETTINGS: dict[str, Any] = {
    "host": "127.0.0.1",
    "workers": 1,
    "loop": "uvloop",
    "http": "httptools",
    "access_log": False,
    "log_level": "warning",
}


def sdk_app() -> Starlette:
    from mcp.server import MCPServer

    server = MCPServer("echo")

    @server.tool()
    def echo(text: str) -> str:
        """Return the text unchanged."""
        return text

    return server.streamable_http_app(json_response=True, stateless_http=True)


def bare_app(bodies: dict[str, str]) -> Starlette:
    """Answer a POST with the stored body for its `Mcp-Method` header."""
    encoded = {method: body.encode() for method, body in bodies.items()}

    async def mcp(request: Request) -> Response:
        await request.body()
        body = encoded[request.headers["mcp-method"]]
        return Response(body, media_type="application/json")

    return Starlette(routes=[Route("/mcp", mcp, methods=["POST"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("server", choices=["sdk", "bare"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bodies", help="bare: JSON file mapping MCP method to response body")
    parser.add_argument("--gc-freeze", action="store_true", help="exempt startup objects from GC")
    args = parser.parse_args()
    if args.server == "sdk":
        app = sdk_app()
    else:
        with open(args.bodies) as file:
            app = bare_app(json.load(file))
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    uvicorn.run(app, port=args.port, **UVICORN_SETTINGS)


if __name__ == "__main__":
    main()
