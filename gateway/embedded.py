"""The embedded engine (``engine.async_llm.AsyncLLM``) as a generation backend.

Preparing a request (templating and tokenizing) runs on a bounded worker pool when it is
large, so a 1 MiB body never stalls other clients' streams; a grammar not yet compiled is
compiled there too; then the engine admits the request or refuses at once.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Protocol

from engine.errors import TooManyTokens
from engine.outputs import OutputKind, RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutputs
from engine.stats import EngineStats
from engine.tokenizer import Tokenizer
from gateway.catalog.catalog import ModelFacts
from gateway.generation import (
    OFF_LOOP_CHARS,
    Completion,
    GenerationRequest,
    Guarded,
    OffLoop,
    Stream,
    TextDelta,
    Tokenized,
    TokenizeRequest,
    prompt_chars,
    tokenize_here,
)
from gateway.ops import tracing
from gateway.ops.metrics import Metrics

if TYPE_CHECKING:  # the engine itself (and torch) is loaded by whoever builds it
    from engine.async_llm import RequestStream


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
        return Guarded(self._run(stream, request), stream)

    async def tokenize(self, request: TokenizeRequest) -> Tokenized:
        tokenizer, limit = self.engine.tokenizer, self.max_model_len
        return await self.off_loop.run(request.chars, tokenize_here, tokenizer, limit, request)

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
