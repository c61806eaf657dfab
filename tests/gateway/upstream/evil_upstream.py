"""A malicious upstream OpenAI server: a real HTTP server process for the fleet tests of what
a gateway does with an upstream that lies, floods or misdirects. The prompt of a
``/v1/completions`` call (or the last message of a chat) names the reply (``SCENARIOS``);
anything else is a short valid completion. Every answer sets a cookie; ``GET /seen`` lists,
per request received, its path and whether it carried a ``Cookie`` and which
``Authorization``. With ``--api-key KEY`` every path but ``/health`` and ``/seen`` answers 401
without ``Authorization: Bearer KEY`` (as vLLM's ``--api-key``). Run: ``python -m
tests.gateway.upstream.evil_upstream --host H --port P [--api-key KEY]``."""

from __future__ import annotations

import argparse
import asyncio
import functools
import zlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tests.gateway.upstream import stand_in

MODEL = "evil-upstream-model"
SSE = "text/event-stream"
USAGE = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
SEPARATORS = "\u2028\u2029\u0085"  # line breaks to str.splitlines, not to SSE
BIG = 10 * 1024 * 1024

seen: list[dict[str, Any]] = []
api_key: str | None = None


def data(body: Any) -> bytes:
    return b"data: " + (body if isinstance(body, bytes) else orjson.dumps(body)) + b"\n\n"


def text_chunk(text: str, finish_reason: Any = None, **extra: Any) -> bytes:
    choice = {"index": 0, "text": text, "finish_reason": finish_reason, **extra}
    return data(
        {"id": "cmpl-evil", "object": "text_completion", "model": MODEL, "choices": [choice]}
    )


def valid(text: str = "ok", usage: Any = USAGE, finish: Any = "length") -> list[bytes]:
    return [
        text_chunk(text),
        text_chunk("", finish),
        data({"choices": [], "usage": usage}),
        data(b"[DONE]"),
    ]


async def endless() -> AsyncIterator[bytes]:
    while True:  # tokens for as long as anyone reads them
        yield text_chunk("x")
        await asyncio.sleep(0)


async def endless_empty() -> AsyncIterator[bytes]:
    yield text_chunk("x")
    while True:  # chunks that carry no token, forever
        yield text_chunk("")
        await asyncio.sleep(0)


async def endless_comments() -> AsyncIterator[bytes]:
    yield text_chunk("x")
    while True:  # SSE comments, two bytes each: no event, ever
        yield b":\n" * 4096
        await asyncio.sleep(0)


async def endless_line() -> AsyncIterator[bytes]:
    yield b'data: {"choices": [{"index": 0, "text": "'
    piece = b"a" * 65536
    while True:  # never a newline
        yield piece
        await asyncio.sleep(0)


async def huge_events() -> AsyncIterator[bytes]:
    while True:  # one 10 MB event after another
        yield text_chunk("a" * BIG)
        await asyncio.sleep(0)


async def stall_after_tokens() -> AsyncIterator[bytes]:
    for _ in range(8):
        yield text_chunk("x")
    await asyncio.sleep(3600)  # no finish_reason, ever
    yield b""


async def comments_after_finish() -> AsyncIterator[bytes]:
    yield text_chunk("x", "length")
    while True:  # the stream never ends after its finish_reason
        yield b": keep-alive\n\n"
        await asyncio.sleep(0.05)


def sequence(chunks: list[bytes]) -> Callable[[], AsyncIterator[bytes]]:
    async def stream() -> AsyncIterator[bytes]:
        for chunk in chunks:
            yield chunk

    return stream


@functools.cache
def gzip_bomb() -> bytes:
    """256 MiB of one chunk's text, gzip-compressed to ~256 KiB."""
    compressor = zlib.compressobj(6, zlib.DEFLATED, 31)
    head = b'data: {"choices": [{"index": 0, "text": "'
    out = [compressor.compress(head)]
    block = b"a" * (1 << 20)
    out += [compressor.compress(block) for _ in range(256)]
    out.append(compressor.flush())
    return b"".join(out)


STREAMS: dict[str, Callable[[], AsyncIterator[bytes]]] = {
    "separators": sequence(valid(SEPARATORS + "after" + SEPARATORS)),
    "malformed": sequence([data(b"{not json"), data(b"[DONE]")]),
    "endless": endless,
    "endless-empty": endless_empty,
    "endless-comments": endless_comments,
    "endless-line": endless_line,
    "huge-events": huge_events,
    "stall-after-tokens": stall_after_tokens,
    "comments-after-finish": comments_after_finish,
    "choices-7": sequence([data({"choices": 7}), data(b"[DONE]")]),
    "prompt-tokens-lots": sequence(valid(usage={**USAGE, "prompt_tokens": "lots"})),
    "usage-plenty": sequence(valid(usage="plenty")),
    "finish-object": sequence(valid(finish={"reason": "stop", "evil": True})),
}
# scenario -> (status, body, headers)
STATUSES: dict[str, tuple[int, bytes, dict[str, str]]] = {
    "status-302": (302, b"", {"location": "http://127.0.0.1:1/elsewhere"}),
    "status-401": (401, b'{"error": {"message": "invalid api key from upstream"}}', {}),
    "status-404": (404, b'{"error": {"message": "no such model upstream"}}', {}),
    "status-400": (400, b'{"error": {"message": "prompt refused: bad field", "param": "x"}}', {}),
    "status-400-html": (400, b"<html>bad request</html>", {}),
    "json-body": (200, orjson.dumps({"choices": [{"text": "ok"}]}), {}),
}


def _record(request: Request) -> None:
    seen.append(
        {
            "path": request.url.path,
            "cookie": request.headers.get("cookie"),
            "authorization": request.headers.get("authorization"),
        }
    )


def _refused(request: Request) -> Response | None:
    if api_key is None or request.headers.get("authorization") == f"Bearer {api_key}":
        return None
    return JSONResponse({"error": {"message": "Unauthorized"}}, status_code=401)


def _cookie(response: Response) -> Response:
    response.set_cookie("evil", "tracked")
    return response


async def completions(request: Request) -> Response:
    _record(request)
    if (refused := _refused(request)) is not None:
        return _cookie(refused)
    body = await request.json()
    scenario = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
    if scenario == "gzip-bomb":
        headers = {"content-encoding": "gzip"}
        return Response(gzip_bomb(), media_type=SSE, headers=headers)
    if scenario in STATUSES:
        status, content, headers = STATUSES[scenario]
        kind = "application/json" if content.startswith(b"{") else "text/html"
        return _cookie(Response(content, status, headers, media_type=kind))
    stream = STREAMS.get(scenario, sequence(valid()))
    return _cookie(StreamingResponse(stream(), media_type=SSE))


async def models(request: Request) -> Response:
    _record(request)
    refused = _refused(request)
    answer = {"object": "list", "data": [{"id": MODEL, "max_model_len": 4096}]}
    return _cookie(refused or JSONResponse(answer))


async def metrics(request: Request) -> Response:
    _record(request)
    return _cookie(_refused(request) or PlainTextResponse("vllm:num_requests_waiting 0\n"))


async def health(request: Request) -> Response:
    _record(request)
    return _cookie(PlainTextResponse(""))


async def report(request: Request) -> Response:
    if request.method == "DELETE":
        seen.clear()
    return JSONResponse(seen)


app = Starlette(
    routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/models", models),
        Route("/metrics", metrics),
        Route("/health", health),
        Route("/readyz", health),
        Route("/seen", report, methods=["GET", "DELETE"]),
    ]
)

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--api-key")
    given = stand_in.options(parser)
    api_key = given.api_key
    gzip_bomb()  # compressed once, before the first call
    stand_in.serve(app, given)
