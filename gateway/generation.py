"""One home for generation requests, whatever front door they came through.

A front door (the MCP tools, the OpenAI API) builds a ``GenerationRequest`` — a prompt or a
conversation, sampling params, a cache key and tenant salt — and ``start``s it on the
``Generations`` the app holds. Where it runs is a ``Backend``: the embedded engine
(``EngineBackend``, below) or a fleet of engine servers (``gateway.upstream.Fleet``). Either
prepares the request (templating and tokenizing in a worker thread when it is large, so a 1 MiB
body never stalls other clients' streams), then admits it or refuses at once. A prompt, or a
text to tokenize, whose length alone shows it cannot fit in ``max_model_len`` tokens is
refused before it is tokenized (``Tokenizer.min_tokens``). What comes back
is one async iterator shape for every front door: ``TextDelta`` items as text arrives, then
one ``Completion``. Closing it (``aclosing``, a cancelled task, a client gone) aborts the
request (at the next step boundary, or by closing the upstream stream) and frees its blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any, Protocol

from engine import OutputKind, RequestOutput, RequestStream, SamplingParams, StructuredOutputs
from engine.errors import TooManyTokens
from engine.stats import EngineStats
from engine.tokenizer import Tokenizer
from gateway.auth.budgets import metered
from gateway.auth.identity import tenant_salt
from gateway.catalog.catalog import ModelFacts
from gateway.function_calls.formats import DEFAULT as DEFAULT_FAMILY
from gateway.function_calls.formats import Family
from gateway.function_calls.functions import Functions
from gateway.function_calls.parser import FunctionCall
from gateway.ops import tracing
from gateway.ops.metrics import Metrics

# Prompts above this many characters are prepared off the event loop (templating and
# tokenizing ~1 MiB takes seconds; a few KiB take microseconds, less than a thread hop).
OFF_LOOP_CHARS = 16_384
PREPARE_WORKERS = 2  # bounded: a flood of huge bodies queues here, not in more threads


class Engine(Protocol):
    """The part of ``engine.AsyncLLM`` the embedded backend uses."""

    model_name: str
    max_model_len: int

    def stats(self) -> EngineStats: ...

    def is_ready(self) -> bool: ...

    def replicas_ready(self) -> list[bool]: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def default_sampling_fields(self) -> dict[str, Any]: ...

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        documents: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]: ...

    def encode_prompt(self, text: str) -> list[int]: ...

    def grammar_compiled(self, spec: StructuredOutputs) -> bool: ...

    def compile_grammar(self, spec: StructuredOutputs) -> None: ...

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        cache_key: str | None = None,
        cache_salt: str | None = None,
        kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> RequestStream: ...


@dataclass(frozen=True)
class GenerationRequest:
    """Exactly one of ``prompt`` (text or token ids) and ``messages`` (a conversation, with
    the ``tools`` and template variables its chat template is rendered with)."""

    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    tools: Functions | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_key: str | None = None
    cache_salt: str | None = None

    @property
    def operation(self) -> str:
        """``gen_ai.operation.name`` (OpenTelemetry semantic conventions)."""
        return "chat" if self.messages is not None else "text_completion"

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as given: what the chat template renders."""
        return None if self.tools is None else self.tools.raw


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str  # new since the previous delta (never a split UTF-8 character; may be empty)
    tokens: int  # generated so far
    token_ids: list[int]  # new since the previous delta
    logprobs: list[dict[int, float]] | None  # one {token id: logprob} per new token, if asked
    # OpenAI ``delta.tool_calls`` entries, from a backend that reads tool calls itself (a fleet)
    tool_calls: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    replica: int  # the engine replica, or the upstream's index in the configured order
    upstream: str | None = None  # the upstream's URL in fleet mode
    stop_reason: str | None = None  # why it stopped when no stop token or string did
    # The calls a backend that reads tool calls itself found (a fleet's upstream); None: the
    # front door reads them out of ``text``.
    tool_calls: list[FunctionCall] | None = None


class OffLoop:
    """Runs preparation work here when it is small, else on a bounded pool of worker threads."""

    def __init__(self) -> None:
        self._workers = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="kvgate-prepare")

    async def run(self, size: int, work: Any, *args: Any) -> Any:
        """``work(*args)`` here when ``size`` is small, else on a worker thread."""
        if size <= OFF_LOOP_CHARS:
            return work(*args)
        return await self.away(work, *args)

    async def away(self, work: Any, *args: Any) -> Any:
        """``work(*args)`` on a worker thread, whatever its size (a grammar compile)."""
        return await asyncio.get_running_loop().run_in_executor(self._workers, work, *args)

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)


Stream = AsyncIterator[TextDelta | Completion]


class Backend(Protocol):
    """Where generation requests run. ``start`` raises ValueError (bad input: the message
    says what to change) or ``engine.AdmissionRefused``, both before anything is queued."""

    model_name: str
    max_model_len: int
    off_loop: OffLoop
    # Tool calls come back already read (a fleet's upstreams render and parse them).
    reads_tool_calls: bool

    @property
    def tokenizer(self) -> Tokenizer | None: ...  # None: a fleet without --tokenizer

    @property
    def default_sampling_fields(self) -> dict[str, Any]: ...

    async def start(self, request: GenerationRequest) -> Stream: ...

    async def tokenize(self, text: str) -> list[int]: ...

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready or not, and the details ``/readyz`` shows (replicas or upstreams)."""
        ...

    def facts(self, replicas: int) -> ModelFacts: ...

    @property
    def stats(self) -> Callable[[], EngineStats] | None:
        """Engine figures for the ``vllm:*`` gauges (None: there is no local engine)."""
        ...

    async def open(self, metrics: Metrics) -> None:
        """Start background work (health checks); count into the app's ``metrics``."""
        ...

    async def aclose(self) -> None: ...


class Generations:
    """What the front doors hold: starts requests on the backend, builds their sampling
    params, and lends its worker threads for other heavy preparation (tokenizing)."""

    def __init__(self, backend: Backend, tool_family: Family = DEFAULT_FAMILY) -> None:
        self.backend = backend
        self.model_name = backend.model_name
        # How this model writes tool calls; None where the backend reads them itself (the
        # front doors then neither constrain the reply to calls nor parse it).
        self.tool_family = None if backend.reads_tool_calls else tool_family

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.backend.tokenizer

    async def start(self, request: GenerationRequest) -> Stream:
        """Prepare and admit ``request`` (ValueError or ``AdmissionRefused`` if not), salted
        with the caller's tenant (never another tenant's cached blocks) and metered against
        its budget as tokens are produced."""
        salted = replace(request, cache_salt=tenant_salt(request.cache_salt))
        return metered(await self.backend.start(salted))

    async def tokenize(self, text: str) -> list[int]:
        return await self.backend.tokenize(text)

    def sampling_params(self, fields: dict[str, Any]) -> SamplingParams:
        """``SamplingParams`` from a request's fields; the model's generation_config.json
        defaults fill those it leaves unset (ValueError naming a bad field)."""
        return SamplingParams.from_dict(fields, defaults=self.backend.default_sampling_fields)

    async def off_loop(self, size: int, work: Any, *args: Any) -> Any:
        return await self.backend.off_loop.run(size, work, *args)


class EngineBackend:
    """The embedded engine (``engine.AsyncLLM``) as a backend."""

    reads_tool_calls = False

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.off_loop = OffLoop()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def default_sampling_fields(self) -> dict[str, Any]:
        return self.engine.default_sampling_fields

    @property
    def stats(self) -> Callable[[], EngineStats]:
        return self.engine.stats

    def facts(self, replicas: int) -> ModelFacts:
        stats = self.engine.stats()
        return ModelFacts(
            name=self.model_name,
            max_model_len=self.max_model_len,
            block_size=stats.block_size,
            num_blocks=stats.num_blocks,
            kv_cache_dtype=stats.cache_dtype,
            replicas=len(stats.per_replica) or replicas,
        )

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ready while every replica steps (a stuck one makes the pod unready, so a load
        balancer steers new traffic elsewhere while the router here skips that replica)."""
        return self.engine.is_ready(), {"replicas": self.engine.replicas_ready()}

    async def open(self, metrics: Metrics) -> None:
        return None  # the engine's lifetime belongs to whoever built it

    async def aclose(self) -> None:
        self.off_loop.close()

    async def start(self, request: GenerationRequest) -> Stream:
        prompt = await self.off_loop.run(prompt_chars(request), self._prompt, request)
        spec = request.params.structured_outputs
        if spec is not None and not self.engine.grammar_compiled(spec):
            await self.off_loop.away(self.engine.compile_grammar, spec)  # ms to seconds
        stream = self.engine.submit(
            prompt, request.params, request.cache_key, request.cache_salt, OutputKind.DELTA
        )
        return self._run(stream, request)

    async def tokenize(self, text: str) -> list[int]:
        tokenizer = self.engine.tokenizer
        return await self.off_loop.run(
            len(text), encode_within, tokenizer, self.max_model_len, text
        )

    def _prompt(self, request: GenerationRequest) -> str | list[int]:
        if request.messages is None:
            assert request.prompt is not None
            if isinstance(request.prompt, str) and len(request.prompt) > OFF_LOOP_CHARS:
                return self.engine.encode_prompt(request.prompt)  # here, not on the loop
            return request.prompt
        try:
            return self.engine.apply_chat_template(
                request.messages,
                tools=request.template_tools,
                chat_template_kwargs=request.chat_template_kwargs,
            )
        except TooManyTokens:
            raise
        except Exception as exc:  # a template may refuse a conversation it cannot format
            raise ValueError(f"messages: the chat template rejected them ({exc})") from exc

    async def _run(
        self, stream: RequestStream, request: GenerationRequest
    ) -> AsyncIterator[TextDelta | Completion]:
        operation, model = request.operation, self.engine.model_name
        last: RequestOutput | None = None
        text: list[str] = []
        async with aclosing(stream):
            with (
                tracing.span(
                    "kvgate.route",
                    **{
                        "kvgate.cache_key.set": request.cache_key is not None,
                        "kvgate.replica": stream.replica,
                    },
                ) as route,
                tracing.span(
                    f"{operation} {model}",
                    route,
                    **{
                        "gen_ai.operation.name": operation,
                        "gen_ai.request.model": model,
                        "gen_ai.request.max_tokens": request.params.max_tokens,
                    },
                ) as run,
            ):
                async for out in stream:
                    if last is None:  # how much of the prompt the replica had cached
                        tracing.annotate(route, **{"kvgate.cached_tokens": out.cached_tokens})
                    last = out
                    if out.text or out.token_ids:
                        text.append(out.text)
                        yield TextDelta(
                            out.text, out.num_output_tokens, out.token_ids, out.logprobs
                        )
                assert last is not None and last.finished
                tracing.annotate(
                    run,
                    **{
                        "gen_ai.usage.input_tokens": len(last.prompt_token_ids),
                        "gen_ai.usage.output_tokens": last.num_output_tokens,
                        "gen_ai.response.finish_reasons": [last.finish_reason or "stop"],
                    },
                )
        yield Completion(
            text="".join(text),
            finish_reason=last.finish_reason or "stop",
            prompt_tokens=len(last.prompt_token_ids),
            completion_tokens=last.num_output_tokens,
            cached_tokens=last.cached_tokens,
            replica=last.replica,
            stop_reason=last.stop_reason,
        )


def encode_within(
    tokenizer: Tokenizer,
    max_model_len: int,
    text: str | list[dict[str, Any]],
    add_special_tokens: bool = True,
) -> list[int]:
    """Token ids for the tokenize doors (a text, or a conversation rendered by the chat
    template): one too long to fit in ``max_model_len`` tokens is refused (``TooManyTokens``)
    without tokenizing it — no such text can be a prompt, and 1 MiB costs ~0.5 s and
    ~150 MiB of transient memory to tokenize."""
    try:
        if isinstance(text, str):
            return tokenizer.encode(text, add_special_tokens, max_model_len)
        return tokenizer.encode_chat(text, max_tokens=max_model_len)
    except TooManyTokens as exc:
        message = f"{'text' if isinstance(text, str) else 'messages'}: {exc} (max_model_len)"
        raise TooManyTokens(message, exc.at_least, exc.limit) from None


def prompt_chars(request: GenerationRequest) -> int:
    """A cheap size estimate of what preparing the request will chew through."""
    if request.messages is not None:
        return messages_chars(request.messages)
    return len(request.prompt) if isinstance(request.prompt, str) else 0


def messages_chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m.get("content", ""))) for m in messages)
