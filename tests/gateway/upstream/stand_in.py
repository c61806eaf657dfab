"""What every stand-in upstream process here shares: its command line (``--host``, ``--port``,
as ``processes.Process`` passes them), an empty 200 for health paths, and serving the app."""

from __future__ import annotations

import argparse

import uvicorn
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp


async def ok(request: Request) -> Response:
    return PlainTextResponse("")


def options(parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The command line: ``--host``, ``--port`` and whatever ``parser`` already declares."""
    parser = parser or argparse.ArgumentParser()
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    return parser.parse_args()


def serve(app: ASGIApp, given: argparse.Namespace) -> None:
    uvicorn.run(app, host=given.host, port=given.port, log_level="warning")
