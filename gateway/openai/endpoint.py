"""The OpenAI-compatible front door: ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions``, and vLLM's ``/tokenize`` and ``/detokenize``.

The same pipeline as ``/mcp`` where the two meet, not a copy of it: Origin/Host rules,
bounded body reads and JSON depth (``gateway.http``), the per-client concurrency limit shared
with MCP calls (``gateway.admission``), the server's call deadline, the generation requests
every front door starts (``gateway.generation``), and ``kvgate_requests_total{api="openai"}``.
A streamed answer is Server-Sent Events ``data: {chunk}`` lines ending ``data: [DONE]``; an
error after the stream began is one ``data: {"error": …}`` event, then ``[DONE]``. A client
that goes away closes the generations, which aborts them at the next step boundary.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, aclosing
from dataclasses import replace
from typing import Any

import orjson
from starlette.types import Receive, Scope, Send

from engine import AdmissionRefused, SamplingParams
from engine.errors import TooManyTokens
from gateway.admission import ConcurrencyLimit, client_key, client_limited, engine_refused
from gateway.generation import (
    Completion,
    GenerationRequest,
    Generations,
    Stream,
    TextDelta,
    encode_within,
    messages_chars,
)
from gateway.http import io as http_io
from gateway.http import security
from gateway.http.security import OriginPolicy
from gateway.openai import requests as parse
from gateway.openai import tool_calls
from gateway.openai.errors import OpenAIError, bad_request, deadline_exceeded, from_refusal
from gateway.openai.responses import (
    Choice,
    Envelope,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    usage_of,
)
from gateway.ops.metrics import Metrics
from gateway.settings import Settings
from gateway.upstream.call import UpstreamError
from protocol.jsonrpc import nesting_depth

logger = logging.getLogger("kvgate.openai")
DONE = b"data: [DONE]\n\n"
CLOSE = [(b"connection", b"close")]


def sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


class OpenAIEndpoint:
    """An ASGI app for the OpenAI routes (mounted on their paths)."""

    def __init__(
        self,
        settings: Settings,
        generations: Generations,
        model: str,
        max_model_len: int,
        metrics: Metrics,
        clients: ConcurrencyLimit,
    ) -> None:
        self.settings = settings
        self.generations = generations
        self.model = model
        self.max_model_len = max_model_len
        self.metrics = metrics
        self.clients = clients
        self.origins = OriginPolicy(settings.host, settings.allowed_origins)
        self.created = int(time.time())
        self.token_text = TokenText(generations.tokenizer)
        self.routes: dict[str, tuple[str, Callable[..., Awaitable[str]]]] = {
            "/v1/models": ("GET", self._models),
            "/v1/completions": ("POST", self._completions),
            "/v1/chat/completions": ("POST", self._chat),
            "/tokenize": ("POST", self._tokenize),
            "/detokenize": ("POST", self._detokenize),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        path = scope["path"]
        headers = http_io.header_map(scope)
        outcome = "error"
        try:
            method, handler = self.routes[path]
            if scope["method"] != method:
                raise OpenAIError(405, f"{path} takes {method}")
            refused = security.refusal(self.origins, scope["headers"])
            if refused is not None:  # foreign or repeated Origin/Host
                raise OpenAIError(refused[0], refused[1], code="forbidden")
            body = await self._body(receive, headers) if method == "POST" else {}
            outcome = await handler(body, headers, receive, send)
        except OpenAIError as error:
            outcome = "rejected" if error.status in (429, 503) else "error"
            await self._error(send, error)
        except http_io.ClientGone:
            outcome = "cancelled"
        except Exception:
            logger.exception("internal error answering %s", path)
            await self._error(send, OpenAIError(500, "Internal error"))
        finally:
            self.metrics.observe(path, None, outcome, time.perf_counter() - started, "openai")

    async def _body(self, receive: Receive, headers: dict[str, str]) -> dict[str, Any]:
        settings = self.settings
        try:
            raw = await http_io.read_bounded(
                receive, headers, settings.max_body_bytes, settings.body_timeout_s
            )
        except http_io.BodyTooLarge:
            raise OpenAIError(
                413, f"Request body exceeds {settings.max_body_bytes} bytes", code="too_large"
            ) from None
        except TimeoutError:
            raise OpenAIError(
                408, f"Request body not received within {settings.body_timeout_s:g} s"
            ) from None
        media = headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise OpenAIError(415, "Content-Type must be application/json")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise bad_request(f"The body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise bad_request("The body must be a JSON object")
        depth = settings.max_json_depth
        if raw.count(b"[") + raw.count(b"{") > depth and nesting_depth(body) > depth:
            raise bad_request(f"JSON nested deeper than {settings.max_json_depth}")
        return body

    async def _error(self, send: Send, error: OpenAIError) -> None:
        if error.status in (429, 503):
            self.metrics.count("kvgate_rejected_requests", reason=error.code or "refused")
        extra = [*error.headers(), *(CLOSE if error.status in (408, 413) else ())]
        await http_io.send_response(send, error.status, error.encode(), headers=extra)

    # -- routes ------------------------------------------------------------------------------

    async def _models(
        self, body: dict[str, Any], headers: dict[str, str], receive: Receive, send: Send
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
        await _send_json(send, {"object": "list", "data": [model]})
        return "ok"

    async def _completions(
        self, body: dict[str, Any], headers: dict[str, str], receive: Receive, send: Send
    ) -> str:
        parse.check_model(body, self.model)
        prompts = parse.completion_prompts(body)
        sampling = parse.sampling(body, chat=False)
        echo = _flag(body, "echo")
        if echo and sampling.stream:
            raise bad_request("'echo' is not supported with 'stream'", "echo")
        base = GenerationRequest(
            self._params(sampling),
            cache_key=sampling.cache_key,
            cache_salt=sampling.cache_salt,
        )
        requests = [replace(base, prompt=p) for p in prompts]
        envelope = Envelope.new("cmpl", self.model)
        answer = _Completions(self, envelope, prompts, echo, sampling)
        return await self._run(requests, sampling, headers, receive, send, answer)

    async def _chat(
        self, body: dict[str, Any], headers: dict[str, str], receive: Receive, send: Send
    ) -> str:
        parse.check_model(body, self.model)
        messages = tool_calls.template_messages(parse.chat_messages(body))
        sampling = parse.sampling(body, chat=True)
        tools, replies = tool_calls.apply(body, sampling, self.generations.tool_family)
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        request = GenerationRequest(
            self._params(sampling),
            messages=messages,
            tools=tools,
            chat_template_kwargs=kwargs,
            cache_key=sampling.cache_key,
            cache_salt=sampling.cache_salt,
        )
        answer = _Chat(self, Envelope.new("chatcmpl", self.model), sampling, replies)
        return await self._run([request], sampling, headers, receive, send, answer)

    async def _tokenize(
        self, body: dict[str, Any], headers: dict[str, str], receive: Receive, send: Send
    ) -> str:
        parse.check_model(body, self.model)
        tokenizer = self.generations.tokenizer
        if tokenizer is None:
            raise OpenAIError(501, "/tokenize needs --tokenizer in fleet mode", code="unsupported")
        special = _flag(body, "add_special_tokens", default=True)
        text: str | list[dict[str, Any]]
        if "messages" in body:
            text = parse.chat_messages(body)
            size = messages_chars(text)
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
            size = len(text)
        else:
            raise bad_request("'prompt' (a string) or 'messages' is required", "prompt")
        try:
            ids = await self.generations.off_loop(
                size, encode_within, tokenizer, self.max_model_len, text, special
            )
        except TooManyTokens as exc:
            raise bad_request(str(exc), "messages" if "messages" in body else "prompt") from None
        strs = None
        if _flag(body, "return_token_strs"):
            strs = [tokenizer.backend.id_to_token(i) for i in ids]
        result = {
            "count": len(ids),
            "max_model_len": self.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }
        await _send_json(send, result)
        return "ok"

    async def _detokenize(
        self, body: dict[str, Any], headers: dict[str, str], receive: Receive, send: Send
    ) -> str:
        parse.check_model(body, self.model)
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
            raise bad_request(f"'tokens' must be a list of token ids in [0, {vocab})", "tokens")
        text = tokenizer.decode(tokens)
        await _send_json(send, {"prompt": text})
        return "ok"

    # -- generation --------------------------------------------------------------------------

    def _params(self, sampling: parse.Sampling) -> SamplingParams:
        try:
            return self.generations.sampling_params(sampling.fields)
        except ValueError as exc:  # a combination the fields alone did not rule out
            raise bad_request(str(exc), str(exc).split(" ")[0].strip(":'")) from None

    async def _run(
        self,
        requests: list[GenerationRequest],
        sampling: parse.Sampling,
        headers: dict[str, str],
        receive: Receive,
        send: Send,
        answer: _Answer,
    ) -> str:
        """Start every choice (``n`` per prompt), then answer as JSON or as a stream."""
        timeout = self.settings.request_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout
        client = client_key(headers.get("authorization"), sampling.cache_key)
        if self.clients.full(client):
            raise from_refusal(client_limited(self.settings.max_concurrency_per_client))
        with self.clients.hold(client):
            async with AsyncExitStack() as stack:
                try:
                    start = self._start(requests, sampling.n, stack)
                    streams = await http_io.until_disconnect(
                        receive, http_io.before(deadline, start)
                    )
                except TimeoutError:
                    raise deadline_exceeded(timeout) from None
                if sampling.stream:
                    work = self._stream(send, answer, streams, deadline, timeout)
                    await http_io.until_disconnect(receive, work)
                    return "ok"
                try:
                    choices = await http_io.until_disconnect(
                        receive, http_io.before(deadline, _collect(streams))
                    )
                except TimeoutError:
                    raise deadline_exceeded(timeout) from None
                except UpstreamError as exc:  # fleet mode: the upstream broke off the call
                    raise _bad_gateway(exc) from None
                await _send_json(send, answer.body(choices))
                return "ok"

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
            streams.append(_prepend(head, first))
            for i in range(1, n):
                streams.append(await self._admit(request, i, stack))
        return streams

    async def _admit(self, request: GenerationRequest, i: int, stack: AsyncExitStack) -> Stream:
        params = request.params
        if i and params.seed is not None:  # n seeded choices: reproducible, and not all alike
            request = replace(request, params=replace(params, seed=params.seed + i))
        try:
            stream = await self.generations.start(request)
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        except AdmissionRefused as exc:
            raise from_refusal(engine_refused(exc)) from None
        return await stack.enter_async_context(aclosing(stream))

    async def _stream(
        self, send: Send, answer: _Answer, streams: list[Stream], deadline: float, timeout: float
    ) -> None:
        await http_io.start_stream(send)
        try:
            async with asyncio.timeout_at(deadline):
                async for index, item in _merged(streams):
                    for chunk in answer.chunks(index, item):
                        await http_io.send_chunk(send, sse(chunk))
                if answer.sampling.include_usage:
                    await http_io.send_chunk(send, sse(answer.usage_chunk()))
        except TimeoutError:
            await http_io.send_chunk(send, sse(deadline_exceeded(timeout).body()))
        except UpstreamError as exc:
            await http_io.send_chunk(send, sse(_bad_gateway(exc).body()))
        except Exception as exc:  # noqa: BLE001 - the stream has begun: say so in it
            logger.warning("stream failed: %s", exc)
            error = OpenAIError(500, f"Generation failed: {exc}")
            await http_io.send_chunk(send, sse(error.body()))
        await http_io.send_chunk(send, DONE, more=False)


class _Answer:
    """Builds one response, or its stream chunks, from the choices' items. In a stream each
    choice's latest delta is held back until the next item, so ``finish_reason`` rides on the
    last content chunk (never a chunk of its own)."""

    kind: str

    def __init__(self, endpoint: OpenAIEndpoint, envelope: Envelope, sampling: parse.Sampling):
        self.endpoint, self.envelope, self.sampling = endpoint, envelope, sampling
        self.top: int | None = sampling.fields.get("logprobs")
        self.done: dict[int, Completion] = {}
        self._held: dict[int, TextDelta] = {}
        self._prompts = 1

    def body(self, choices: list[Choice]) -> dict[str, Any]:
        out = [self.choice(c) for c in choices]
        done = [c.done for c in choices if c.done is not None]
        return self.envelope.wrap(self.kind, out, usage=usage_of(done, self._prompts))

    def chunks(self, index: int, item: TextDelta | Completion) -> list[dict[str, Any]]:
        held = self._held.pop(index, None)
        if isinstance(item, TextDelta):
            self._held[index] = item
            return [] if held is None else [self.chunk(index, held, None)]
        self.done[index] = item
        last = held if held is not None else TextDelta("", item.completion_tokens, [], None)
        return [self.chunk(index, last, item.finish_reason)]

    def usage_chunk(self) -> dict[str, Any]:
        done = [self.done[i] for i in sorted(self.done)]
        return self.envelope.wrap(self.kind, [], usage=usage_of(done, self._prompts))

    def choice(self, choice: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, index: int, delta: TextDelta, finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError


class _Completions(_Answer):
    kind = "text_completion"

    def __init__(
        self,
        endpoint: OpenAIEndpoint,
        envelope: Envelope,
        prompts: list[str | list[int]],
        echo: bool,
        sampling: parse.Sampling,
    ) -> None:
        super().__init__(endpoint, envelope, sampling)
        self.prompts, self.echo, self._prompts = prompts, echo, len(prompts)

    def _prompt_text(self, index: int) -> str:
        prompt = self.prompts[index // self.sampling.n]
        if isinstance(prompt, str):
            return prompt
        tokenizer = self.endpoint.generations.tokenizer
        if tokenizer is None:
            raise bad_request("'echo' of token ids needs --tokenizer in fleet mode", "echo")
        return tokenizer.decode(prompt)

    def _logprobs(self, ids: list[int], entries: list[dict[int, float]], offset: int) -> Any:
        if self.top is None:
            return None
        return completion_logprobs(ids, entries, self.top, self.endpoint.token_text, offset)

    def choice(self, choice: Choice) -> dict[str, Any]:
        assert choice.done is not None
        prefix = self._prompt_text(choice.index) if self.echo else ""
        return {
            "index": choice.index,
            "text": prefix + "".join(choice.text),
            "logprobs": self._logprobs(choice.token_ids, choice.logprobs, len(prefix)),
            "finish_reason": choice.done.finish_reason,
        }

    def chunk(self, index: int, delta: TextDelta, finish_reason: str | None) -> dict[str, Any]:
        choice = {
            "index": index,
            "text": delta.text,
            "logprobs": self._logprobs(delta.token_ids, delta.logprobs or [], 0),
            "finish_reason": finish_reason,
        }
        return self.envelope.wrap(self.kind, [choice])


class _Chat(_Answer):
    kind = "chat.completion"

    def __init__(
        self,
        endpoint: OpenAIEndpoint,
        envelope: Envelope,
        sampling: parse.Sampling,
        replies: tool_calls.ToolReplies | None = None,
    ):
        super().__init__(endpoint, envelope, sampling)
        self._opened: set[int] = set()
        self.replies = replies  # tool calls are parsed out of the text

    def _logprobs(self, ids: list[int], entries: list[dict[int, float]]) -> Any:
        if self.top is None:
            return None
        return chat_logprobs(ids, entries, self.top, self.endpoint.token_text)

    def choice(self, choice: Choice) -> dict[str, Any]:
        assert choice.done is not None
        text, finish_reason = "".join(choice.text), choice.done.finish_reason
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if choice.done.tool_calls:  # the backend read them (fleet mode): as it found them
            message, finish_reason = tool_calls.relayed(text, choice.done)
        elif self.replies is not None:
            message, finish_reason = self.replies.message(text, finish_reason)
        return {
            "index": choice.index,
            "message": message,
            "logprobs": self._logprobs(choice.token_ids, choice.logprobs),
            "finish_reason": finish_reason,
            "stop_reason": choice.done.stop_reason,
        }

    def chunks(self, index: int, item: TextDelta | Completion) -> list[dict[str, Any]]:
        """The first chunk of each choice carries the role, as the OpenAI API sends it."""
        chunks = []
        if index not in self._opened:
            self._opened.add(index)
            role = {"index": index, "delta": {"role": "assistant", "content": ""}}
            chunks.append(self._wrap({**role, "logprobs": None, "finish_reason": None}))
        return chunks + [c for c in super().chunks(index, item) if not _empty(c)]

    def chunk(self, index: int, delta: TextDelta, finish_reason: str | None) -> dict[str, Any]:
        fields: dict[str, Any] = {"content": delta.text} if delta.text else {}
        done = self.done.get(index) if finish_reason is not None else None
        if delta.tool_calls:  # the backend's own delta.tool_calls (fleet mode), as they came
            fields["tool_calls"] = delta.tool_calls
        if done is not None and done.tool_calls:
            finish_reason = tool_calls.relayed_finish_reason(done)
        if self.replies is not None:
            fields, finish_reason = self.replies.delta(index, delta.text, finish_reason)
        choice = {
            "index": index,
            "delta": fields,
            "logprobs": self._logprobs(delta.token_ids, delta.logprobs or []),
            "finish_reason": finish_reason,
        }
        if done is not None:
            choice["stop_reason"] = done.stop_reason
        return self._wrap(choice)

    def usage_chunk(self) -> dict[str, Any]:
        return {**super().usage_chunk(), "object": "chat.completion.chunk"}

    def _wrap(self, choice: dict[str, Any]) -> dict[str, Any]:
        return self.envelope.wrap("chat.completion.chunk", [choice])


def _bad_gateway(exc: UpstreamError) -> OpenAIError:
    """Fleet mode: the upstream broke off the call, or answered what cannot be relayed."""
    return OpenAIError(502, f"Upstream failed: {exc}", code="bad_gateway")


def _empty(chunk: dict[str, Any]) -> bool:
    """A chunk with nothing to say (the tokens of a tool call's tags are not content)."""
    choice = chunk["choices"][0]
    return not choice["delta"] and choice["finish_reason"] is None and choice["logprobs"] is None


async def _send_json(send: Send, body: dict[str, Any]) -> None:
    await http_io.send_response(send, 200, orjson.dumps(body))


def _flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean", name)
    return value


async def _prepend(head: TextDelta | Completion, rest: Stream) -> Stream:
    yield head
    async for item in rest:
        yield item


async def _collect(streams: list[Stream]) -> list[Choice]:
    """Drain every choice concurrently into its accumulated ``Choice``."""

    async def drain(index: int, stream: Stream) -> Choice:
        choice = Choice(index)
        async for item in stream:
            if isinstance(item, TextDelta):
                choice.add(item)
            else:
                choice.done = item
        return choice

    return list(await asyncio.gather(*(drain(i, s) for i, s in enumerate(streams))))


async def _merged(streams: list[Stream]) -> AsyncIterator[tuple[int, TextDelta | Completion]]:
    """Every choice's items as they come, tagged with the choice index."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, TextDelta | Completion] | BaseException | None] = asyncio.Queue(
        maxsize=len(streams)
    )

    async def pump(index: int, stream: Stream) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put(None)
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
