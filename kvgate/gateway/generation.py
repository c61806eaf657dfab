"""What a generation is, whatever door asked for it and whatever backend runs it.

A door builds a ``GenerationRequest`` — a prompt or a conversation, sampling params, the
functions the model may call, a cache key and tenant salt — and starts it through
``kvgate.gateway.calls.generations.Generations``, which hands it to a ``Backend``: the embedded
engine (``kvgate.gateway.embedded``) or a fleet of engine servers (``kvgate.gateway.upstream``). What comes
back is one async iterator shape for every door: ``TextDelta`` items as text arrives, then
one ``Completion``. Closing it (``aclosing``, a cancelled task, a client gone) aborts the
request (at the next step boundary, or by closing the upstream stream) and frees its blocks.
A prompt, or a text to tokenize, whose length alone shows it cannot fit in ``max_model_len``
tokens is refused before it is tokenized (``Tokenizer.min_tokens``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kvgate.engine.errors import InvalidArgument, TooManyTokens
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.stats import EngineStats
from kvgate.engine.tokenization.tokenizer import Tokenizer
from kvgate.gateway.catalog.catalog import ModelFacts
from kvgate.gateway.function_calls.functions import Functions
from kvgate.gateway.function_calls.parser import FunctionCall
from kvgate.gateway.ops.metrics import Metrics

T = TypeVar("T")

# Prompts above this many characters are prepared off the event loop (templating and
# tokenizing ~1 MiB takes seconds; a few KiB take microseconds, less than a thread hop).
OFF_LOOP_CHARS = 16_384
PREPARE_WORKERS = 2  # bounded: a flood of large bodies queues here, not in more threads
# Work on bodies above this many characters (a 1 MiB conversation, 128 tools' schemas) takes
# seconds of pure Python each: it goes one at a time to a thread of its own, so two of it never
# contend with the event loop and the step thread for the GIL at once (two such threads paused
# /healthz and other tenants' streams for 150 ms-1 s), and ordinary bodies never wait behind it.
HUGE_CHARS = 262_144


@dataclass(frozen=True)
class GenerationRequest:
    """Exactly one of ``prompt`` (text or token ids) and ``messages`` (a conversation, with
    the ``tools`` and template variables its chat template is rendered with)."""

    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    functions: Functions | None = None  # the functions the model may call (OpenAI ``tools``)
    chat_template_kwargs: dict[str, Any] | None = None
    cache_key: str | None = None
    cache_salt: str | None = None
    adapter: str | None = None  # a LoRA adapter's name (the OpenAI ``model``); None: the base
    # The caller reads the answer as it comes; False: only once whole (a non-streamed
    # OpenAI call), so a fleet asks its upstream for one JSON answer instead of a stream.
    streamed: bool = True

    @property
    def operation(self) -> str:
        """``gen_ai.operation.name`` (OpenTelemetry semantic conventions)."""
        return "chat" if self.messages is not None else "text_completion"

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as given: what the chat template renders."""
        return None if self.functions is None else self.functions.raw


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str  # new since the previous delta (never a split UTF-8 character; may be empty)
    tokens: int  # generated so far
    token_ids: list[int]  # new since the previous delta
    logprobs: list[dict[int, float]] | None  # one {token id: logprob} per new token, if asked
    # OpenAI ``delta.tool_calls`` entries: calls that began or grew (function calls read)
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str = ""  # thinking new since the previous delta (a reasoning parser is on)
    # The reply ended with this delta: its Completion follows at once, with no wait between
    # (a stream's writer may hold this delta to send the two as one chunk).
    final: bool = False


@dataclass(frozen=True)
class Completion:
    text: str  # the reply; once function calls are read, its content without the calls
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    replica: int  # the engine replica, or the upstream's index in the configured order
    upstream: str | None = None  # the upstream's URL in fleet mode
    stop_reason: str | None = None  # why it stopped when no stop token or string did
    # The calls the reply made, once read (``kvgate.gateway.function_calls.reading``); None when the
    # request let the model call no function.
    tool_calls: list[FunctionCall] | None = None
    # The thinking split from the reply (``kvgate.gateway.reasoning``); None when no parser is on
    # or the reply did not think.
    reasoning: str | None = None


@dataclass(frozen=True)
class TokenizeRequest:
    """A text, or a conversation rendered by the chat template, to count in tokens; a
    conversation as vLLM's ``/tokenize`` takes it: with the tools and template variables the
    template renders, and the assistant's turn opened or not."""

    text: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    token_strs: bool = False  # also each token's vocabulary string
    tools: list[dict[str, Any]] | None = None  # as given: what the chat template renders
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    @property
    def chars(self) -> int:
        if self.text is not None:
            return len(self.text)
        return messages_chars(self.messages or []) + len(str(self.tools or ""))

    def template(self) -> dict[str, Any]:
        """The chat template's options (``Tokenizer.encode_chat``) for ``messages``."""
        return {
            "add_generation_prompt": self.add_generation_prompt,
            "tools": self.tools,
            "chat_template_kwargs": self.chat_template_kwargs,
        }


@dataclass(frozen=True)
class EmbeddingsRequest:
    """The inputs of one embeddings call (texts or token ids), embedded each on its own."""

    inputs: list[str | list[int]]
    cache_salt: str | None = None

    @property
    def chars(self) -> int:
        return sum(len(i) if isinstance(i, str) else 0 for i in self.inputs)


@dataclass(frozen=True)
class Embeddings:
    vectors: list[list[float]]  # one per input, in order: L2-normalized, last-token pooled
    prompt_tokens: int


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter a backend serves: its name (the ``model`` that selects it) and folder."""

    name: str
    path: str


@dataclass(frozen=True)
class Tokenized:
    ids: list[int]
    token_strs: list[str] | None = None


class OffLoop:
    """Runs preparation work here when it is small, else on a bounded pool of worker threads;
    the largest on one thread of its own, one at a time."""

    def __init__(self) -> None:
        self._workers = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="kvgate-prepare")
        self._huge = ThreadPoolExecutor(1, thread_name_prefix="kvgate-prepare-huge")

    async def run(self, size: int, work: Callable[..., T], *args: Any) -> T:
        """``work(*args)`` here when ``size`` is small, else on a worker thread."""
        if size <= OFF_LOOP_CHARS:
            return work(*args)
        pool = self._huge if size > HUGE_CHARS else self._workers
        return await asyncio.get_running_loop().run_in_executor(pool, work, *args)

    def close(self) -> None:
        for pool in (self._workers, self._huge):
            pool.shutdown(wait=False, cancel_futures=True)


class Stream(Protocol):
    """A generation's items: ``TextDelta``s, then one ``Completion``; ``aclose`` aborts it."""

    def __aiter__(self) -> AsyncIterator[TextDelta | Completion]: ...

    async def __anext__(self) -> TextDelta | Completion: ...

    async def aclose(self) -> None: ...


class Closable(Protocol):
    async def aclose(self) -> None: ...


class Guarded:
    """``items``, an async generator reading ``source``, whose ``aclose`` closes ``source``
    too: an async generator closed before it started never runs its ``finally``, which would
    leave the request running (a choice started, then a later one refused)."""

    def __init__(self, items: Stream, source: Closable) -> None:
        self._items, self._source = items, source

    def __aiter__(self) -> Guarded:
        return self

    async def __anext__(self) -> TextDelta | Completion:
        return await anext(self._items)

    async def aclose(self) -> None:
        try:
            await self._items.aclose()
        finally:
            await self._source.aclose()  # closing twice is a no-op for every source


class Backend(Protocol):
    """Where generation requests run. ``start`` raises ValueError (bad input: the message
    says what to change; ``kvgate.engine.errors.InvalidArgument`` names the field) or
    ``kvgate.engine.errors.AdmissionRefused``, both before anything is queued; its stream may raise
    ``kvgate.engine.errors.EngineStepError`` or ``kvgate.gateway.calls.errors.UpstreamFailed``. Only
    ``kvgate.gateway.calls.generations`` calls a backend: it translates those into the call errors."""

    model_name: str
    max_model_len: int
    off_loop: OffLoop
    # Function calls come back already read (a fleet's upstreams render and parse them).
    reads_tool_calls: bool

    @property
    def tokenizer(self) -> Tokenizer | None: ...  # None: a fleet without --tokenizer

    @property
    def default_sampling_fields(self) -> dict[str, Any]: ...

    async def start(self, request: GenerationRequest) -> Stream: ...

    async def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """The token ids ``request`` would prefill, refused (ValueError) where ``start`` would
        refuse its prompt: what a render answers, so it never shows a prompt the call refuses."""
        ...

    async def tokenize(self, request: TokenizeRequest) -> Tokenized: ...

    async def embed(self, request: EmbeddingsRequest) -> Embeddings:
        """Every input's embedding; raises what ``start`` raises, and the step's or the
        upstream's failure (``EngineStepError`` / ``UpstreamFailed``) itself."""
        ...

    def adapters(self) -> list[Adapter] | None:
        """The LoRA adapters served (None: not known here; a fleet's upstreams decide)."""
        ...

    async def load_adapter(self, name: str, path: str, replace: bool) -> None:
        """Load a PEFT adapter folder as ``name`` (``kvgate.engine.errors.AdapterError``)."""
        ...

    async def unload_adapter(self, name: str) -> bool:
        """Forget ``name``; False when it was not loaded."""
        ...

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


def encode_within(
    tokenizer: Tokenizer,
    max_model_len: int,
    text: str | list[dict[str, Any]],
    add_special_tokens: bool = True,
    **template: Any,
) -> list[int]:
    """Token ids for the tokenize doors (a text, or a conversation rendered by the chat
    template with ``template``'s options): one too long to fit in ``max_model_len`` tokens is
    refused (``TooManyTokens``) without tokenizing it — no such text can be a prompt, and
    1 MiB costs ~0.5 s and ~150 MiB of transient memory to tokenize."""
    try:
        if isinstance(text, str):
            return tokenizer.encode(text, add_special_tokens, max_model_len)
        return tokenizer.encode_chat(text, max_tokens=max_model_len, **template)
    except TooManyTokens as exc:
        message = f"{'text' if isinstance(text, str) else 'messages'}: {exc} (max_model_len)"
        raise TooManyTokens(message, exc.at_least, exc.limit) from None


def check_max_tokens(params: SamplingParams, prompt_tokens: int, context: int) -> None:
    """vLLM's server check: a ``max_tokens`` the caller chose must fit in the context after
    the prompt (one past the context is refused however short the prompt), else
    ``InvalidArgument``; a default one only bounds the output (it stops at the context's
    end). A prompt that fills the context is the engine's to refuse, naming it."""
    asked = params.max_tokens
    if prompt_tokens >= context:
        return
    if asked > context or ("max_tokens" in params.given and prompt_tokens + asked > context):
        raise InvalidArgument(
            f"max_tokens: this model's context length is {context} tokens, but "
            f"{prompt_tokens + asked} were asked for ({prompt_tokens} in the prompt, {asked} "
            "to generate): lower max_tokens or shorten the prompt",
            "max_tokens",
        )


def tokenize_here(tokenizer: Tokenizer, max_model_len: int, request: TokenizeRequest) -> Tokenized:
    """``request`` tokenized with a tokenizer of this process (within ``max_model_len``)."""
    if request.text is not None:
        ids = encode_within(tokenizer, max_model_len, request.text, request.add_special_tokens)
    else:
        messages = request.messages or []
        ids = encode_within(tokenizer, max_model_len, messages, **request.template())
    strs = [tokenizer.backend.id_to_token(i) or "" for i in ids] if request.token_strs else None
    return Tokenized(ids, strs)


def prompt_chars(request: GenerationRequest) -> int:
    """A cheap size estimate of what preparing the request will chew through (its tools too:
    the chat template renders them)."""
    if request.messages is not None:
        tools = request.functions.chars if request.functions is not None else 0
        return messages_chars(request.messages) + tools
    return len(request.prompt) if isinstance(request.prompt, str) else 0


def messages_chars(messages: list[dict[str, Any]]) -> int:
    return sum(len(str(m.get("content", ""))) for m in messages)
