"""An upstream OpenAI server that records every request body it is sent: a real HTTP server
process for the fleet tests of what a gateway forwards. ``/v1/completions`` and
``/v1/chat/completions`` answer a short valid completion (streamed or not, as asked);
``GET /recorded`` lists the bodies received since the last ``DELETE /recorded``.
``/tokenize`` answers one token per byte of the prompt, or, for the prompts in
``TOKENIZE_FAULTS``, a malformed, refused or oversized answer. Run: ``python -m
tests.gateway.upstream.recording_upstream --host H --port P``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.gateway.upstream import stand_in

MODEL = "recording-upstream-model"
MAX_MODEL_LEN = 4096
TEXT = "ok"
USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
LONG_MESSAGE = "the upstream refuses this prompt; " * 20  # > 200 characters

recorded: list[dict[str, Any]] = []


def _valid(tokens: list[int]) -> dict[str, Any]:
    return {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens}


# prompt -> (status, body: JSON-able or raw bytes, headers)
TOKENIZE_FAULTS: dict[str, tuple[int, Any, dict[str, str]]] = {
    "not-json": (200, b"{tokens: [1, 2", {}),
    "not-an-object": (200, [1, 2, 3], {}),
    "tokens-not-ints": (200, {**_valid([1, 2]), "tokens": [1, "2"]}, {}),
    "negative-token": (200, {**_valid([1, 2]), "tokens": [1, -2]}, {}),
    "bool-token": (200, {**_valid([1, 2]), "tokens": [1, True]}, {}),
    "count-wrong": (200, {**_valid([1, 2]), "count": 3}, {}),
    "no-max-model-len": (200, {"count": 2, "tokens": [1, 2]}, {}),
    "strs-wrong-length": (200, {**_valid([1, 2]), "token_strs": ["a"]}, {}),
    "strs-not-strings": (200, {**_valid([1, 2]), "token_strs": ["a", 2]}, {}),
    "huge": (200, _valid(list(range(200_000))), {}),
    "refuse": (400, {"error": {"message": LONG_MESSAGE, "param": "prompt"}}, {}),
    "refuse-flat": (400, {"object": "error", "message": "bad prompt", "code": 400}, {}),
    "busy": (429, {"error": {"message": "slow down"}}, {"retry-after": "7"}),
    "broken": (500, {"error": {"message": "internal"}}, {}),
}


def _chunk(chat: bool, finish_reason: str | None, text: str, role: bool = False) -> bytes:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    if chat:
        choice["delta"] = {"role": "assistant", "content": ""} if role else {"content": text}
    else:
        choice["text"] = text
    body = {
        "id": "cmpl-rec",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [choice],
    }
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def _stream(chat: bool) -> AsyncIterator[bytes]:
    if chat:
        yield _chunk(chat, None, "", role=True)
    yield _chunk(chat, None, TEXT)
    yield _chunk(chat, "length", "")
    yield b"data: " + orjson.dumps({"choices": [], "usage": USAGE}) + b"\n\n"
    yield b"data: [DONE]\n\n"


def _whole(chat: bool) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
    if chat:
        choice["message"] = {"role": "assistant", "content": TEXT}
    else:
        choice["text"] = TEXT
    return {
        "id": "cmpl-rec",
        "object": "chat.completion" if chat else "text_completion",
        "created": 0,
        "model": MODEL,
        "choices": [choice],
        "usage": USAGE,
    }


async def _generate(request: Request, chat: bool) -> Response:
    body = await request.json()
    recorded.append({"path": request.url.path, "body": body})
    if body.get("stream"):
        return StreamingResponse(_stream(chat), media_type="text/event-stream")
    return JSONResponse(_whole(chat))


async def completions(request: Request) -> Response:
    return await _generate(request, chat=False)


async def chat(request: Request) -> Response:
    return await _generate(request, chat=True)


async def tokenize(request: Request) -> Response:
    body = await request.json()
    recorded.append({"path": request.url.path, "body": body})
    prompt = body.get("prompt")
    if prompt in TOKENIZE_FAULTS:
        status, answer, headers = TOKENIZE_FAULTS[prompt]
        content = answer if isinstance(answer, bytes) else orjson.dumps(answer)
        return Response(content, status, headers, media_type="application/json")
    text = prompt if isinstance(prompt, str) else orjson.dumps(body.get("messages")).decode()
    tokens = list(text.encode())
    strs = [chr(t) for t in tokens] if body.get("return_token_strs") else None
    return JSONResponse({**_valid(tokens), "token_strs": strs})


async def get_recorded(request: Request) -> Response:
    return JSONResponse(recorded)


async def clear_recorded(request: Request) -> Response:
    recorded.clear()
    return PlainTextResponse("")


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [{"id": MODEL, "max_model_len": MAX_MODEL_LEN}]})


app = Starlette(
    routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/recorded", get_recorded, methods=["GET"]),
        Route("/recorded", clear_recorded, methods=["DELETE"]),
        Route("/v1/models", models),
        Route("/health", stand_in.ok),
        Route("/readyz", stand_in.ok),
    ]
)

if __name__ == "__main__":
    stand_in.serve(app, stand_in.options())
