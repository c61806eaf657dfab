"""``POST /v1/responses``: the Responses API over the one call path.

The body is read into a chat (``responses_input``), continued from a stored response when it
names ``previous_response_id`` (``response_store``, Redis only), admitted and run through
``Lifecycle`` and ``Generations`` like every chat — so it is served by the embedded engine
and by a fleet alike —, and answered by ``responses_output.ResponseBuilder``: one Response
object, or its events as Server-Sent Events (``event: <type>`` + ``data: {…}``, no
``[DONE]``, as OpenAI streams them). An error after the stream began is an ``error`` event.
A stored response is saved before its last event is sent, so a client may continue at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

import orjson
from starlette.types import Receive, Send

from kvgate.gateway.calls.errors import CallError, DeadlineExceeded
from kvgate.gateway.calls.generations import Generations
from kvgate.gateway.calls.lifecycle import Call, Lifecycle
from kvgate.gateway.function_calls.functions import template_messages
from kvgate.gateway.generation import Completion, GenerationRequest, Stream
from kvgate.gateway.http import io as http_io
from kvgate.gateway.openai import requests as parse
from kvgate.gateway.openai import responses_input
from kvgate.gateway.openai.errors import OpenAIError, wire
from kvgate.gateway.openai.response_store import ResponseStore, refuse_without_store
from kvgate.gateway.openai.responses_output import Event, ResponseBuilder

logger = logging.getLogger("kvgate.openai")
Finished = Callable[[], Awaitable[None]]


def sse_event(event: Event) -> bytes:
    data = http_io.line_safe(orjson.dumps(event))
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


class ResponsesRoute:
    def __init__(
        self, generations: Generations, model: str, calls: Lifecycle, store: ResponseStore | None
    ) -> None:
        self.generations, self.model, self.calls, self.store = generations, model, calls, store

    async def __call__(
        self,
        fields: dict[str, Any],
        size: int,
        headers: dict[str, str],
        receive: Receive,
        send: Send,
    ) -> str:
        request, ask, conversation = await self.read(fields, size)
        adapter, sampling = request.adapter, ask.sampling
        stored = ask.store and self.store is not None
        extra = {"store": stored, "previous_response_id": ask.previous_response_id}
        builder = ResponseBuilder(
            adapter or self.model, {**ask.echo, "truncation": "disabled"}, extra
        )

        async def finished() -> None:
            if stored and self.store is not None:
                final = builder.response(builder.status)
                await self.store.save(final, conversation + builder.assistant_messages())

        async with self.calls.admit(receive, headers, sampling.cache_key) as call:
            stream = await call.run(self.generations.start(request))
            async with aclosing(stream):
                if sampling.stream:
                    await call.watch(self._stream(send, builder, stream, call, finished))
                    return "ok"
                await call.run(_drain(builder, stream))
                await finished()
        body = orjson.dumps(builder.response(builder.status))
        await http_io.send_response(send, 200, body)
        return "ok"

    async def read(
        self, fields: dict[str, Any], size: int
    ) -> tuple[GenerationRequest, responses_input.ResponsesAsk, list[dict[str, Any]]]:
        """The body as a chat (continued from the stored response it names), what it asked,
        and the conversation without the instructions (what a stored response keeps)."""
        adapter = parse.check_model(fields, self.model, self.generations.adapters())
        ask = await self.generations.off_loop(size, responses_input.read, fields)
        if self.store is None:
            refuse_without_store(ask.store, ask.previous_response_id)
        earlier: list[dict[str, Any]] = []
        if ask.previous_response_id is not None and self.store is not None:
            earlier = await self.store.conversation(ask.previous_response_id)
        conversation = earlier + ask.input
        system = [{"role": "system", "content": ask.instructions}] if ask.instructions else []
        sampling = ask.sampling
        request = GenerationRequest(
            self.generations.sampling_params(sampling.fields),
            messages=template_messages(system + conversation),
            functions=ask.functions,
            cache_key=sampling.cache_key,
            cache_salt=sampling.cache_salt,
            adapter=adapter,
            streamed=sampling.stream,
        )
        return request, ask, conversation

    async def _stream(
        self, send: Send, builder: ResponseBuilder, stream: Stream, call: Call, finished: Finished
    ) -> None:
        await http_io.start_stream(send)
        try:
            for event in builder.start():
                await http_io.send_chunk(send, sse_event(event))
            async with asyncio.timeout_at(call.deadline):
                async for item in stream:
                    events = builder.add(item)
                    if isinstance(item, Completion):
                        await finished()
                    for event in events:
                        await http_io.send_chunk(send, sse_event(event))
        except TimeoutError:
            await self._error(send, builder, wire(DeadlineExceeded(call.timeout_s)))
        except CallError as exc:
            await self._error(send, builder, wire(exc))
        except Exception as exc:  # noqa: BLE001 - the stream has begun: say so in it
            logger.warning("responses stream failed: %s", exc)
            await self._error(send, builder, OpenAIError(500, f"Generation failed: {exc}"))
        await http_io.send_chunk(send, b"", more=False)

    async def _error(self, send: Send, builder: ResponseBuilder, error: OpenAIError) -> None:
        body = error.body()["error"]
        event = builder.error_event(body.get("code"), body["message"], body.get("param"))
        await http_io.send_chunk(send, sse_event(event))


async def _drain(builder: ResponseBuilder, stream: Stream) -> None:
    async for item in stream:
        builder.add(item)
