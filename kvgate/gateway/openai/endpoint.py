"""The OpenAI-compatible door: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/v1/embeddings``, ``/v1/responses`` (``responses_route``), and vLLM's ``/tokenize``,
``/detokenize``, render (``openai.render``: a call's prompt ids, not run) and LoRA routes
(``openai.adapters``; a request's ``model`` names the base model or a LoRA adapter).

This module parses the OpenAI wire and renders its answers; what lies between is the call
path both doors share: ``kvgate.gateway.calls.lifecycle`` (Origin/Host, the body within its size,
time and media type, JSON depth, admission under the client's and tenant's limits, the
deadline, the disconnect watch) and ``kvgate.gateway.calls.generations`` (the backend, whichever it
is). Failures are call errors, worded once by ``kvgate.gateway.openai.errors.wire``. A streamed
answer is Server-Sent Events ``data: {chunk}`` lines ending ``data: [DONE]``; an error after
the stream began is one ``data: {"error": …}`` event, then ``[DONE]``. A client that goes away
closes the generations, which aborts them at the next step boundary.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack, aclosing
from dataclasses import dataclass, replace
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from kvgate.gateway.calls.errors import BadInput, CallError, DeadlineExceeded
from kvgate.gateway.calls.generations import Generations
from kvgate.gateway.calls.lifecycle import Call, Lifecycle
from kvgate.gateway.function_calls.functions import template_messages
from kvgate.gateway.generation import GenerationRequest, Stream, TokenizeRequest
from kvgate.gateway.http import io as http_io
from kvgate.gateway.openai import adapters, embeddings, render
from kvgate.gateway.openai import requests as parse
from kvgate.gateway.openai.answers import (
    Answer,
    ChatAnswer,
    CompletionsAnswer,
    collect,
    merged,
    prepend,
)
from kvgate.gateway.openai.errors import OpenAIError, wire
from kvgate.gateway.openai.response_store import ResponseStore
from kvgate.gateway.openai.responses import Choice, Envelope, TokenText
from kvgate.gateway.openai.responses_route import ResponsesRoute
from kvgate.gateway.ops import access_log, tracing
from kvgate.gateway.ops.metrics import Metrics

logger = logging.getLogger("kvgate.openai")
DONE = b"data: [DONE]\n\n"
PLAIN = b"text/plain; charset=utf-8"
CLOSE = [(b"connection", b"close")]


@dataclass(frozen=True)
class Body:
    """A request's JSON object and its size in bytes (large ones are read on a worker)."""

    fields: dict[str, Any]
    size: int = 0


Handler = Callable[[Body, dict[str, str], Receive, Send], Awaitable[str]]


def sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + http_io.line_safe(orjson.dumps(chunk)) + b"\n\n"


class OpenAIEndpoint:
    """An ASGI app for the OpenAI routes (mounted on their paths)."""

    def __init__(
        self,
        generations: Generations,
        model: str,
        metrics: Metrics,
        calls: Lifecycle,
        store: ResponseStore | None = None,
        lora_updates: bool = False,
        created: int | None = None,
    ) -> None:
        self.generations = generations
        self.model = model
        self.max_model_len = generations.max_model_len
        self.metrics = metrics
        self.calls = calls
        self.created = int(time.time()) if created is None else created
        self.token_text = TokenText(generations.tokenizer)
        self.responses = ResponsesRoute(generations, model, calls, store)
        self.routes: dict[str, tuple[str, Handler]] = {
            "/v1/models": ("GET", self._models),
            "/v1/completions": ("POST", self._completions),
            "/v1/chat/completions": ("POST", self._chat),
            "/v1/completions/render": ("POST", self._render_completions),
            "/v1/chat/completions/render": ("POST", self._render_chat),
            "/v1/embeddings": ("POST", self._embeddings),
            "/v1/responses": ("POST", self._responses),
            "/v1/responses/render": ("POST", self._render_responses),
            "/tokenize": ("POST", self._tokenize),
            "/detokenize": ("POST", self._detokenize),
        }
        if lora_updates:  # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING
            load = self._adapter_change(lambda body: adapters.load(generations, body, model))
            unload = self._adapter_change(lambda body: adapters.unload(generations, body))
            self.routes["/v1/load_lora_adapter"] = ("POST", load)
            self.routes["/v1/unload_lora_adapter"] = ("POST", unload)
        self.inference_paths = frozenset(p for p, (m, _) in self.routes.items() if m == "POST")

    def owns(self, path: str) -> bool:
        """Whether an answer on ``path`` speaks OpenAI (its routes, and anything under /v1/:
        the app routes both here, so an unknown one is this door's 404)."""
        return path in self.routes or path.startswith("/v1/")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        http_io.track_served_by()
        started = time.perf_counter()
        path = scope["path"]
        headers = http_io.header_map(scope)
        outcome = "error"
        try:
            self.calls.check_origin(scope["headers"])
            method, handler = self._route(path, scope["method"])
            with tracing.server_span(f"{method} {path}", headers, {"http.route": path}):
                body = Body({})
                if method == "POST":
                    raw = await self.calls.read_body(receive, headers)
                    # a large body is parsed (and depth-checked) on a worker: others wait not
                    fields = await self.generations.off_loop(len(raw), self.calls.parse_object, raw)
                    body = Body(fields, len(raw))
                outcome = await handler(body, headers, receive, send)
        except CallError as error:
            outcome = "rejected" if error.reason is not None else "error"
            await self._error(send, error)
        except http_io.ClientGone:
            outcome = "cancelled"
        except Exception:
            logger.exception("internal error answering %s", path)
            await self._error(send, OpenAIError(500, "Internal error"))
        finally:
            # An unknown path is a client's choice: one label for all of them, as MCP's methods
            label = path if path in self.routes else "unknown"
            self.metrics.observe(label, None, outcome, time.perf_counter() - started, "openai")
            access_log.called("openai", label, None, outcome)

    def _route(self, path: str, method: str) -> tuple[str, Handler]:
        """The route's method and handler: an unknown path is a 404 and a wrong method a 405
        (with ``Allow``), in OpenAI's words as every other error here."""
        route = self.routes.get(path)
        if route is None:
            raise OpenAIError(404, f"Invalid URL ({method} {path})", code="not_found")
        if method != route[0] and not (method == "HEAD" and route[0] == "GET"):
            raise OpenAIError(
                405,
                f"Method {method} not allowed on {path}: it takes {route[0]}",
                code="method_not_allowed",
                allow=route[0] if route[0] == "POST" else "GET, HEAD",
            )
        return route

    async def _error(self, send: Send, error: CallError) -> None:
        if error.reason is not None:
            self.metrics.count("kvgate_rejected_requests", reason=error.reason)
        answer = wire(error)
        extra = [*answer.headers(), *(CLOSE if answer.status in (408, 413) else ())]
        await http_io.send_response(send, answer.status, answer.encode(), headers=extra)

    # -- routes ------------------------------------------------------------------------------

    async def _models(
        self, request: Body, headers: dict[str, str], receive: Receive, send: Send
    ) -> str:
        model = {
            "id": self.model,
            "object": "model",
            "created": self.created,
            "owned_by": "kvgate",
            "root": self.model,
            "parent": None,
            "max_model_len": self.max_model_len,
        }
        loras = adapters.cards(
            self.generations.adapters(), self.model, self.created, self.max_model_len
        )
        await _send_json(send, {"object": "list", "data": [model, *loras]})
        return "ok"

    def _adapter_change(self, change: Callable[[dict[str, Any]], Awaitable[str]]) -> Handler:
        """A LoRA load/unload route: admitted as any call, answered in vLLM's plain text."""

        async def handle(
            request: Body, headers: dict[str, str], receive: Receive, send: Send
        ) -> str:
            async with self.calls.admit(receive, headers):
                text = await change(request.fields)
            await http_io.send_response(send, 200, text.encode(), content_type=PLAIN)
            return "ok"

        return handle

    async def _completions(
        self, request: Body, headers: dict[str, str], receive: Receive, send: Send
    ) -> str:
        prompts, sampling, echo, base = await self.generations.off_loop(
            request.size, self._read_completions, request.fields
        )
        requests = [replace(base, prompt=p) for p in prompts]
        envelope = Envelope.new("cmpl", base.adapter or self.model)
        tracing.describe("text_completion", envelope.model, envelope.id)
        tokenizer = self.generations.tokenizer
        answer = CompletionsAnswer(envelope, sampling, self.token_text, prompts, echo, tokenizer)
        return await self._run(requests, sampling, headers, receive, send, answer)

    def _read_completions(
        self, body: dict[str, Any]
    ) -> tuple[list[str | list[int]], parse.Sampling, bool, GenerationRequest]:
        """The body's fields (on a worker when the body is large)."""
        adapter = parse.check_model(body, self.model, self.generations.adapters())
        prompts = parse.completion_prompts(body)
        sampling = parse.sampling(body, chat=False)
        echo = _flag(body, "echo")
        if echo and sampling.stream:
            raise BadInput("'echo' is not supported with 'stream'", "echo")
        base = GenerationRequest(
            self.generations.sampling_params(sampling.fields),
            cache_key=sampling.cache_key,
            cache_salt=sampling.cache_salt,
            adapter=adapter,
            streamed=sampling.stream,
        )
        return prompts, sampling, echo, base

    async def _chat(
        self, request: Body, headers: dict[str, str], receive: Receive, send: Send
    ) -> str:
        generation, sampling = await self.generations.off_loop(
            request.size, self._read_chat, request.fields
        )
        envelope = Envelope.new("chatcmpl", generation.adapter or self.model)
        tracing.describe("chat", envelope.model, envelope.id)
        answer = ChatAnswer(envelope, sampling, self.token_text)
        return await self._run([generation], sampling, headers, receive, send, answer)

    def _read_chat(self, body: dict[str, Any]) -> tuple[GenerationRequest, parse.Sampling]:
        """The body's fields, on a worker when the body is large: checking the tools' JSON
        Schemas takes seconds for 128 tools in 1 MiB, the messages tens of milliseconds."""
        adapter = parse.check_model(body, self.model, self.generations.adapters())
        messages = template_messages(parse.chat_messages(body))
        sampling = parse.sampling(body, chat=True)
        functions = parse.chat_functions(body)
        kwargs = _template_kwargs(body)
        generation = GenerationRequest(
            self.generations.sampling_params(sampling.fields),
            messages=messages,
            functions=functions,
            chat_template_kwargs=kwargs,
            cache_key=sampling.cache_key,
            cache_salt=sampling.cache_salt,
            adapter=adapter,
            streamed=sampling.stream,
        )
        return generation, sampling

    async def _embeddings(
        self, request: Body, headers: dict[str, str], receive: Receive, send: Send
    ) -> str:
        asked = await self.generations.off_loop(
            request.size, embeddings.read, request.fields, self.model, self.generations.adapters()
        )
        tracing.describe("embeddings", self.model)
        async with self.calls.admit(receive, headers) as call:
            result = await call.run(self.generations.embed(asked.request))
        size = sum(map(len, result.vectors)) * 8  # ~20 bytes of JSON a float; dumps is quick
        body = await self.generations.off_loop(
            size, embeddings.encoded_answer, result, self.model, asked.encoding
        )
        await http_io.send_response(send, 200, body)
        return "ok"

    async def _responses(
        self, request: Body, headers: dict[str, str], receive: Receive, send: Send
    ) -> str:
        return await self.responses(request.fields, request.size, headers, receive, send)

    async def aclose(self) -> None:
        if self.responses.store is not None:
            await self.responses.store.aclose()

    async def _tokenize(
        self, request: Body, headers: dict[str, str], receive: Receive, send: Send
    ) -> str:
        body = request.fields
        parse.check_model(body, self.model, self.generations.adapters())
        strs = _flag(body, "return_token_strs")
        if "messages" in body:  # vLLM's chat form: the template's tools and variables too
            functions = parse.chat_functions(body)
            tokenize = TokenizeRequest(
                messages=template_messages(parse.chat_messages(body)),  # as the call renders
                token_strs=strs,
                tools=None if functions is None else functions.raw,
                chat_template_kwargs=_template_kwargs(body),
                add_generation_prompt=_flag(body, "add_generation_prompt", default=True),
            )
        elif isinstance(body.get("prompt"), str):
            add_special = _flag(body, "add_special_tokens", default=True)
            tokenize = TokenizeRequest(body["prompt"], None, add_special, strs)
        else:
            raise BadInput("'prompt' (a string) or 'messages' is required", "prompt")
        async with self.calls.admit(receive, headers) as call:
            tokenized = await call.run(self.generations.tokenize(tokenize))
        result = {
            "count": len(tokenized.ids),
            "max_model_len": self.max_model_len,
            "tokens": tokenized.ids,
            "token_strs": tokenized.token_strs,
        }
        await _send_json(send, result)
        return "ok"

    async def _render_chat(
        self, request: Body, headers: dict[str, str], receive: Receive, send: Send
    ) -> str:
        generation, sampling = await self.generations.off_loop(
            request.size, self._read_chat, request.fields
        )
        return await self._render_one(
            "chatcmpl-", generation, sampling, request, "messages", headers, receive, send
        )

    async def _render_responses(
        self, request: Body, headers: dict[str, str], receive: Receive, send: Send
    ) -> str:
        generation, ask, _ = await self.responses.read(request.fields, request.size)
        return await self._render_one(
            "resp_", generation, ask.sampling, request, "input", headers, receive, send
        )

    async def _render_one(
        self,
        prefix: str,
        generation: GenerationRequest,
        sampling: parse.Sampling,
        request: Body,
        prompt: str,
        headers: dict[str, str],
        receive: Receive,
        send: Send,
    ) -> str:
        """A chat's render: the prompt its call would prefill (its template with its tools)."""
        async with self.calls.admit(receive, headers) as call:
            ids = await call.run(self.generations.prompt_ids(generation, prompt))
        (request_id,) = render.request_ids(prefix, 1)
        answer = self._rendered(request_id, ids, generation, sampling, request.fields, prompt)
        await _send_json(send, answer)
        return "ok"

    async def _render_completions(
        self, request: Body, headers: dict[str, str], receive: Receive, send: Send
    ) -> str:
        prompts, sampling, _, base = await self.generations.off_loop(
            request.size, self._read_completions, request.fields
        )
        async with self.calls.admit(receive, headers) as call:
            prompt_ids = [
                await call.run(self.generations.prompt_ids(replace(base, prompt=p), "prompt"))
                for p in prompts
            ]
        ids = render.request_ids("cmpl-", len(prompts))
        answer = [
            self._rendered(i, p, base, sampling, request.fields, "prompt")
            for i, p in zip(ids, prompt_ids, strict=True)
        ]
        await http_io.send_response(send, 200, orjson.dumps(answer))
        return "ok"

    def _rendered(
        self,
        request_id: str,
        ids: list[int],
        generation: GenerationRequest,
        sampling: parse.Sampling,
        body: dict[str, Any],
        prompt: str,
    ) -> dict[str, Any]:
        most = render.max_tokens(generation.params, len(ids), self.max_model_len, prompt)
        return render.generate_request(
            request_id,
            ids,
            render.sampling_params(generation.params, sampling.n, most),
            body.get("model"),
            sampling.stream,
            body.get("stream_options"),
            sampling.cache_salt,
        )

    async def _detokenize(
        self, request: Body, headers: dict[str, str], receive: Receive, send: Send
    ) -> str:
        body = request.fields
        parse.check_model(body, self.model, self.generations.adapters())
        tokens = body.get("tokens")
        tokenizer = self.generations.tokenizer
        if tokenizer is None:
            raise OpenAIError(
                501, "/detokenize needs --tokenizer in fleet mode", code="unsupported"
            )
        vocab = tokenizer.vocab_size
        if not (
            isinstance(tokens, list)
            and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens
            )
        ):
            raise BadInput(f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
        async with self.calls.admit(receive, headers):
            text = tokenizer.decode(tokens)
        await _send_json(send, {"prompt": text})
        return "ok"

    # -- generation --------------------------------------------------------------------------

    async def _run(
        self,
        requests: list[GenerationRequest],
        sampling: parse.Sampling,
        headers: dict[str, str],
        receive: Receive,
        send: Send,
        answer: Answer,
    ) -> str:
        """Start every choice (``n`` per prompt), then answer as JSON or as a stream."""
        async with (
            self.calls.admit(receive, headers, sampling.cache_key) as call,
            AsyncExitStack() as stack,
        ):
            if not sampling.stream:  # started and collected under one watch of the client
                choices = await call.run(self._collected(requests, sampling.n, stack))
                await _send_json(send, answer.body(choices))
                return "ok"
            streams = await call.run(self._start(requests, sampling.n, stack))
            await call.watch(self._stream(send, answer, streams, call))
            return "ok"

    async def _collected(
        self, requests: list[GenerationRequest], n: int, stack: AsyncExitStack
    ) -> list[Choice]:
        return await collect(await self._start(requests, n, stack))

    async def _start(
        self, requests: list[GenerationRequest], n: int, stack: AsyncExitStack
    ) -> list[Stream]:
        """Choices in OpenAI's order (prompt by prompt, n each). A prompt's later choices start
        once its first has been prefilled, so they reuse its KV blocks from the prefix cache."""
        streams: list[Stream] = []
        for request in requests:
            first = await self._admit(request, 0, stack)
            if n == 1:
                streams.append(first)
                continue
            head = await anext(first)  # its prefill is done: its blocks are published
            streams.append(prepend(head, first))
            for i in range(1, n):
                streams.append(await self._admit(request, i, stack))
        return streams

    async def _admit(self, request: GenerationRequest, i: int, stack: AsyncExitStack) -> Stream:
        params = request.params
        if i and params.seed is not None:  # n seeded choices: reproducible, and not all alike
            request = replace(request, params=replace(params, seed=params.seed + i))
        stream = await self.generations.start(request)
        return await stack.enter_async_context(aclosing(stream))

    async def _stream(self, send: Send, answer: Answer, streams: list[Stream], call: Call) -> None:
        await http_io.start_stream(send)
        try:
            async with asyncio.timeout_at(call.deadline):
                async for index, item in merged(streams):
                    for chunk in answer.chunks(index, item):
                        await http_io.send_chunk(send, sse(chunk))
                if answer.sampling.include_usage:
                    await http_io.send_chunk(send, sse(answer.usage_chunk()))
        except TimeoutError:
            await http_io.send_chunk(send, sse(wire(DeadlineExceeded(call.timeout_s)).body()))
        except CallError as exc:
            await http_io.send_chunk(send, sse(wire(exc).body()))
        except Exception as exc:  # noqa: BLE001 - the stream has begun: say so in it
            logger.warning("stream failed: %s", exc)
            error = OpenAIError(500, f"Generation failed: {exc}")
            await http_io.send_chunk(send, sse(error.body()))
        await http_io.send_chunk(send, DONE, more=False)


async def _send_json(send: Send, body: dict[str, Any]) -> None:
    await http_io.send_response(send, 200, orjson.dumps(body))


def _flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise BadInput(f"'{name}' must be a boolean", name)
    return value


def _template_kwargs(body: dict[str, Any]) -> dict[str, Any] | None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadInput("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    return kwargs
