"""The embedded engine (``kvgate.engine.async_llm.AsyncLLM``) as a generation backend.

Preparing a request (templating and tokenizing) runs on a bounded worker pool when it is
large, so a 1 MiB body never stalls other clients' streams; a grammar not yet compiled is
compiled on threads of its own (``GrammarCompiles``); then the engine admits the request or
refuses at once. An embeddings call's inputs are all checked (tokenized off the loop when
large) before any is queued, then run as the engine's embedding requests, at most
``EMBED_WINDOW`` of one call in the engine at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Protocol

from kvgate.engine.outputs import EmbeddingOutput, OutputKind, RequestOutput
from kvgate.engine.request_options import RequestOptions
from kvgate.engine.sampling_params import SamplingParams, StructuredOutputs
from kvgate.engine.stats import EngineStats
from kvgate.engine.tokenization.tokenizer import Tokenizer
from kvgate.gateway.auth.identity import current as current_identity
from kvgate.gateway.catalog.catalog import ModelFacts
from kvgate.gateway.generation import (
    Adapter,
    Completion,
    Embeddings,
    EmbeddingsRequest,
    GenerationRequest,
    Guarded,
    OffLoop,
    Stream,
    TextDelta,
    Tokenized,
    TokenizeRequest,
    check_max_tokens,
    prompt_chars,
    tokenize_here,
)
from kvgate.gateway.grammar_compiles import GrammarCompiles
from kvgate.gateway.ops import tracing
from kvgate.gateway.ops.metrics import Metrics

if TYPE_CHECKING:  # the engine itself (and torch) is loaded by whoever builds it
    from kvgate.engine.outputs import RequestOutput

# One embeddings call's inputs in the engine at once: a call of 2,048 inputs neither fills the
# waiting queues (``max_waiting``) nor waits on a refusal, and still fills every step.
EMBED_WINDOW = 64


class EngineStream(Protocol):
    """A submitted request's outputs (``kvgate.engine.async_llm.RequestStream`` in this process,
    ``kvgate.engine.process.core_client.RemoteStream`` for an engine in a process of its own)."""

    @property
    def replica(self) -> int: ...

    async def admitted(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def aclose(self) -> None: ...


class LoadedAdapter(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def path(self) -> str: ...


class Engine(Protocol):
    """The part of ``engine.AsyncLLM`` the embedded backend uses; ``engine.EngineClient``
    offers the same over a socket to the engine's own process. Blocking calls
    (``compile_grammar``, ``add_lora``, ``remove_lora``) are made on worker threads."""

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

    def checked_prompt(self, prompt: str | list[int]) -> list[int]: ...

    def grammar_compiled(self, spec: StructuredOutputs) -> bool: ...

    def compile_grammar(self, spec: StructuredOutputs) -> None: ...

    def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        options: RequestOptions = ...,
    ) -> EngineStream: ...

    def encode_embedding_input(self, prompt: str | list[int]) -> list[int]: ...

    async def embed(
        self,
        prompt: str | list[int],
        cache_key: str | None = None,
        cache_salt: str | None = None,
    ) -> EmbeddingOutput: ...
    def add_lora(self, name: str, path: str, replace: bool = False) -> LoadedAdapter: ...

    def remove_lora(self, name: str) -> bool: ...

    def list_loras(self) -> Sequence[LoadedAdapter]: ...


class EngineBackend:
    """The embedded engine (``engine.AsyncLLM``) as a backend."""

    reads_tool_calls = False

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.model_name = engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.off_loop = OffLoop()
        self.grammars = GrammarCompiles(
            engine.compile_grammar, max_bytes=engine.stats().max_grammar_bytes
        )

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
        self.grammars.close()

    async def start(self, request: GenerationRequest) -> Stream:
        prompt = await self.prompt_ids(request)
        check_max_tokens(request.params, len(prompt), self.max_model_len)
        spec = request.params.structured_outputs
        if spec is not None and not self.engine.grammar_compiled(spec):
            identity = current_identity()  # ms to seconds, on a thread of its own
            await self.grammars.compile(spec, "" if identity is None else identity.tenant)
        options = RequestOptions(
            request.cache_key, request.cache_salt, request.adapter, OutputKind.DELTA
        )
        stream = self.engine.submit(prompt, request.params, options)
        try:  # at once in this process; a round trip to an engine process of its own
            await stream.admitted()
        except BaseException:
            await stream.aclose()
            raise
        return Guarded(self._run(stream, request), stream)

    def adapters(self) -> list[Adapter]:
        return [Adapter(a.name, a.path) for a in self.engine.list_loras()]

    async def load_adapter(self, name: str, path: str, replace: bool) -> None:
        """On a thread: reading and checking the files takes milliseconds to seconds."""
        await asyncio.to_thread(self.engine.add_lora, name, path, replace)

    async def unload_adapter(self, name: str) -> bool:
        """On a thread: an engine in a process of its own answers after a round trip."""
        return await asyncio.to_thread(self.engine.remove_lora, name)

    async def prompt_ids(self, request: GenerationRequest) -> list[int]:
        """What ``start`` submits, or its error (on a worker when the prompt is large)."""
        return await self.off_loop.run(prompt_chars(request), self._prompt, request)

    async def tokenize(self, request: TokenizeRequest) -> Tokenized:
        tokenizer, limit = self.engine.tokenizer, self.max_model_len
        return await self.off_loop.run(request.chars, tokenize_here, tokenizer, limit, request)

    async def embed(self, request: EmbeddingsRequest) -> Embeddings:
        prompts = await self.off_loop.run(request.chars, self._embedding_inputs, request.inputs)
        window = asyncio.Semaphore(EMBED_WINDOW)

        async def one(prompt: list[int]) -> EmbeddingOutput:
            async with window:
                return await self.engine.embed(prompt, cache_salt=request.cache_salt)

        tasks = [asyncio.ensure_future(one(p)) for p in prompts]
        try:
            outputs = await asyncio.gather(*tasks)
        finally:  # one refused or failed, or the call cancelled: the others are aborted
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return Embeddings(
            [o.embedding for o in outputs], sum(len(o.prompt_token_ids) for o in outputs)
        )

    def _embedding_inputs(self, inputs: list[str | list[int]]) -> list[list[int]]:
        """Every input's token ids, checked before any is queued (on a worker when large)."""
        return [self.engine.encode_embedding_input(i) for i in inputs]

    def _prompt(self, request: GenerationRequest) -> list[int]:
        """The prompt's token ids, checked as the engine checks what it is submitted (a
        rendered chat too: its template bounds only what its length alone shows)."""
        prompt = request.prompt
        if request.messages is not None:
            prompt = self.engine.apply_chat_template(
                request.messages,
                tools=request.template_tools,
                chat_template_kwargs=request.chat_template_kwargs,
            )
        assert prompt is not None
        return self.engine.checked_prompt(prompt)

    async def _run(
        self, stream: EngineStream, request: GenerationRequest
    ) -> AsyncGenerator[TextDelta | Completion]:
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
                            out.text,
                            out.num_output_tokens,
                            out.token_ids,
                            out.logprobs,
                            final=out.finished,
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
