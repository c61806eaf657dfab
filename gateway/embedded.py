"""The embedded engine (``engine.async_llm.AsyncLLM``) as a generation backend.

Preparing a request (templating and tokenizing) runs on a bounded worker pool when it is
large, so a 1 MiB body never stalls other clients' streams; a grammar not yet compiled is
compiled on threads of its own (``GrammarCompiles``); then the engine admits the request or
refuses at once.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Protocol

from engine.errors import InvalidArgument, TooManyTokens
from engine.outputs import OutputKind, RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutputs
from engine.stats import EngineStats
from engine.tokenizer import Tokenizer
from gateway.auth.identity import current as current_identity
from gateway.catalog.catalog import ModelFacts
from gateway.generation import (
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


SMALL_GRAMMAR_BYTES = 4 * 2**10  # specs up to this compile in ~0.1 s or less (a schema, a tool)
GRAMMAR_COMPILE_TIMEOUT_S = 20.0  # a started compile a call waits for (the largest: 1-4 s)


class _Compile:
    """One spec's compile, whoever waits for it."""

    def __init__(self, work: Callable[[], None], loop: asyncio.AbstractEventLoop) -> None:
        self.work = work
        self.started_at = 0.0
        self.started: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.waiters = 0


class _Lane:
    """One compile thread. Tenants waiting on it take turns: the next compile is the oldest
    of the tenant served least since it began waiting (a tenant with a queue of compiles gets
    one, then every other waiting tenant gets one), so no tenant waits for more than one
    compile of each other tenant's."""

    def __init__(self, name: str) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._queues: OrderedDict[str, deque[_Compile]] = OrderedDict()
        self._served: dict[str, int] = {}  # compiles started, per tenant still waiting
        self._busy = False

    def submit(self, tenant: str, job: _Compile) -> None:
        self._queues.setdefault(tenant, deque()).append(job)
        self._next()

    def _next(self) -> None:
        while not self._busy and self._queues:
            tenant = min(self._queues, key=lambda t: self._served.get(t, 0))  # first of least
            queue = self._queues[tenant]
            job = queue.popleft()
            if not queue:
                del self._queues[tenant]
            if job.waiters == 0:  # every call for it went away before it started
                job.done.cancel()
                continue
            self._busy = True
            self._served[tenant] = self._served.get(tenant, 0) + 1
            job.started_at = time.monotonic()
            job.started.set_result(None)
            future = asyncio.wrap_future(self._thread.submit(job.work))
            future.add_done_callback(functools.partial(self._finished, tenant, job))

    def _finished(self, tenant: str, job: _Compile, future: asyncio.Future[None]) -> None:
        self._busy = False
        if tenant not in self._queues:
            self._served.pop(tenant, None)  # nothing more waiting: its count starts over
        if not job.done.done():
            if future.cancelled():
                job.done.cancel()
            elif (exc := future.exception()) is not None:
                job.done.set_exception(exc)
            else:
                job.done.set_result(None)
        self._next()

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


class GrammarCompiles:
    """Grammar compiles off the event loop, bounded so that no tenant's compiles hold up
    another's: two threads of their own (not the prepare pool's, so tokenizing never waits
    behind a compile), one for specs up to ``SMALL_GRAMMAR_BYTES`` and one for larger ones,
    so a tiny new schema never waits behind a big compile; on each, tenants take turns; one
    spec compiles once however many calls wait for it; and a call waits at most ``timeout_s``
    for a compile once it has started (then a 400 naming ``structured_outputs``; the compile
    runs out and fills the cache). Specs over the engine's ``max_grammar_bytes`` are refused
    before they queue. Runs on the event loop (not thread-safe)."""

    def __init__(
        self,
        compile_grammar: Callable[[StructuredOutputs], None],
        max_bytes: int = 0,
        timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S,
    ) -> None:
        self._compile_grammar = compile_grammar
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self._lanes = (_Lane("kvgate-prepare-grammar-s"), _Lane("kvgate-prepare-grammar-l"))
        self._pending: dict[str, _Compile] = {}

    async def compile(self, spec: StructuredOutputs, tenant: str) -> None:
        if self.max_bytes:
            spec.check_size(self.max_bytes)
        key = spec.digest
        job = self._pending.get(key)
        if job is None:
            job = _Compile(
                functools.partial(self._compile_grammar, spec), asyncio.get_running_loop()
            )
            self._pending[key] = job
            job.done.add_done_callback(functools.partial(self._forget, key))
            job.waiters += 1  # before it can start: a job nobody waits for is skipped
            self._lanes[spec.size > SMALL_GRAMMAR_BYTES].submit(tenant, job)
        else:
            job.waiters += 1
        try:  # queued: the call's own deadline bounds the wait for a turn
            await asyncio.wait((job.started, job.done), return_when=asyncio.FIRST_COMPLETED)
            if not job.done.done():
                left = job.started_at + self.timeout_s - time.monotonic()
                await asyncio.wait_for(asyncio.shield(job.done), max(left, 0.0))
            await job.done
        except TimeoutError:
            raise InvalidArgument(
                f"structured_outputs.{spec.kind}: not compiled within {self.timeout_s:g} s; "
                "use a smaller schema or grammar",
                "structured_outputs",
            ) from None
        finally:
            job.waiters -= 1

    def _forget(self, key: str, done: asyncio.Future[None]) -> None:
        self._pending.pop(key, None)
        if not done.cancelled():
            done.exception()  # retrieved: every call waiting for it may have gone

    def close(self) -> None:
        for lane in self._lanes:
            lane.close()


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
        prompt = await self.off_loop.run(prompt_chars(request), self._prompt, request)
        self._check_max_tokens(request.params, len(prompt))
        spec = request.params.structured_outputs
        if spec is not None and not self.engine.grammar_compiled(spec):
            identity = current_identity()  # ms to seconds, on a thread of its own
            await self.grammars.compile(spec, "" if identity is None else identity.tenant)
        stream = self.engine.submit(
            prompt, request.params, request.cache_key, request.cache_salt, OutputKind.DELTA
        )
        return Guarded(self._run(stream, request), stream)

    async def tokenize(self, request: TokenizeRequest) -> Tokenized:
        tokenizer, limit = self.engine.tokenizer, self.max_model_len
        return await self.off_loop.run(request.chars, tokenize_here, tokenizer, limit, request)

    def _check_max_tokens(self, params: SamplingParams, prompt_tokens: int) -> None:
        """vLLM's server check: a ``max_tokens`` the caller chose must fit in the context after
        the prompt (one past the context is refused however short the prompt), else 400; a
        default one only bounds the output (it stops at the context's end)."""
        context, asked = self.max_model_len, params.max_tokens
        if prompt_tokens >= context:
            return  # the engine refuses the prompt itself, naming it
        if asked > context or ("max_tokens" in params.given and prompt_tokens + asked > context):
            raise InvalidArgument(
                f"max_tokens: this model's context length is {context} tokens, but "
                f"{prompt_tokens + asked} were asked for ({prompt_tokens} in the prompt, {asked} "
                "to generate): lower max_tokens or shorten the prompt",
                "max_tokens",
            )

    def _prompt(self, request: GenerationRequest) -> list[int]:
        """The prompt's token ids (on a worker when it is large; its length is checked)."""
        if request.messages is None:
            assert request.prompt is not None
            if isinstance(request.prompt, str):
                return self.engine.encode_prompt(request.prompt)
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
