"""An upstream OpenAI server whose streamed tool calls are good or malformed on request: a
real HTTP server process for the fleet tests of what a gateway does with outside data.
The last user message names the reply (``SCENARIOS``). Run: ``python -m
tests.gateway.upstream.bad_upstream --host H --port P``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.gateway.upstream import stand_in

MODEL = "bad-upstream-model"
FIRST = {"index": 0, "id": "call_up_0", "type": "function", "function": {"name": "get_weather"}}
GOOD = [
    [{**FIRST, "function": {**FIRST["function"], "arguments": ""}}],
    [{"index": 0, "function": {"arguments": '{"city": '}}],
    [{"index": 0, "function": {"arguments": '"Paris", "unit": "celsius"}'}}],
    [{"index": 1, "id": "call_up_1", "type": "function", "function": {"name": "now"}}],
    [{"index": 1, "function": {"arguments": "{}"}}],
]
# Each scenario: the delta.tool_calls values to send, one chunk each (a str: a raw data line).
SCENARIOS: dict[str, list[Any]] = {
    "good": GOOD,
    "not-a-list": [{"index": 0}],
    "no-name": [[{"index": 0, "id": "call_up_0", "function": {"arguments": "{}"}}]],
    "skipped-index": [[{**FIRST, "index": 1}]],
    "arguments-object": [[{**FIRST, "function": {"name": "now", "arguments": {"a": 1}}}]],
    "not-json": ["{not json"],
    "late": [*GOOD[:2], [{"index": "0", "function": {"arguments": "}"}}]],
}


def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
    body = {
        "id": "chatcmpl-up",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def reply(scenario: list[Any]) -> AsyncIterator[bytes]:
    yield chunk({"role": "assistant", "content": ""})
    for calls in scenario:
        yield (
            b"data: " + calls.encode() + b"\n\n"
            if isinstance(calls, str)
            else chunk({"tool_calls": calls})
        )
    yield chunk({}, "tool_calls")
    usage = {"prompt_tokens": 3, "completion_tokens": len(scenario), "total_tokens": 8}
    yield b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n"
    yield b"data: [DONE]\n\n"


async def chat(request: Request) -> Response:
    body = await request.json()
    scenario = SCENARIOS[body["messages"][-1]["content"]]
    return StreamingResponse(reply(scenario), media_type="text/event-stream")


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": MODEL, "max_model_len": 4096}]})


app = Starlette(
    routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models),
        Route("/health", stand_in.ok),
        Route("/readyz", stand_in.ok),
    ]
)

if __name__ == "__main__":
    stand_in.serve(app, stand_in.options())
