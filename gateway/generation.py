"""One home for generation requests, whatever front door they came through.

A front door (the MCP tools today, the OpenAI API next) builds a ``GenerationRequest`` —
a prompt or a conversation, sampling params, a cache key and tenant salt — and ``start``s it:
the prompt is rendered and tokenized (in a worker thread when it is large, so a 1 MiB body
never stalls other clients' streams), then the engine admits it or refuses at once. What
comes back is one async iterator shape for every front door: ``TextDelta`` items as text
arrives, then one ``Completion``. Closing it (``aclosing``, a cancelled task, a client gone)
aborts the request at the next step boundary and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from engine import OutputKind, RequestOutput, RequestStream, SamplingParams
from gateway.auth.budgets import metered
from gateway.auth.identity import tenant_salt
from gateway.ops import tracing

# Prompts above this many characters are prepared off the event loop (templating and
# tokenizing ~1 MiB takes seconds; a few KiB take microseconds, less than a thread hop).
OFF_LOOP_CHARS = 16_384
PREPARE_WORKERS = 2  # bounded: a flood of huge bodies queues here, not in more threads


class Engine(Protocol):
    """The part of ``engine.AsyncLLM`` generation uses."""

    model_name: str

    @property
    def tokenizer(self) -> Any: ...

    @property
    def default_sampling_fields(self) -> dict[str, Any]: ...

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        documents: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]: ...

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
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    cache_key: str | None = None
    cache_salt: str | None = None

    @property
    def operation(self) -> str:
        """``gen_ai.operation.name`` (OpenTelemetry semantic conventions)."""
        return "chat" if self.messages is not None else "text_completion"


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str  # new since the previous delta (never a split UTF-8 character; may be empty)
    tokens: int  # generated so far
    token_ids: list[int]  # new since the previous delta
    logprobs: list[dict[int, float]] | None  # one {token id: logprob} per new token, if asked


@dataclass(frozen=True)
class Completion:
    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    replica: int


class Generations:
    """Starts generation requests on the engine; owns the worker threads that prepare them."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._workers = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="kvgate-prepare")

    async def start(self, request: GenerationRequest) -> AsyncIterator[TextDelta | Completion]:
        """Prepare and admit ``request``. Raises ValueError (bad input: the message says what
        to change) or ``engine.AdmissionRefused``, both before anything is queued."""
        prompt = await self.off_loop(_chars(request), self._prompt, request)
        salt = tenant_salt(request.cache_salt)  # the caller's tenant: never another's blocks
        stream = self.engine.submit(
            prompt, request.params, request.cache_key, salt, OutputKind.DELTA
        )
        return metered(self._run(stream, request))  # tokens count against the tenant's budget

    def sampling_params(self, fields: dict[str, Any]) -> SamplingParams:
        """``SamplingParams`` from a request's fields; the model's generation_config.json
        defaults fill those it leaves unset (ValueError naming a bad field)."""
        return SamplingParams.from_dict(fields, defaults=self.engine.default_sampling_fields)

    async def off_loop(self, size: int, work: Any, *args: Any) -> Any:
        """``work(*args)`` here when ``size`` is small, else on a worker thread."""
        if size <= OFF_LOOP_CHARS:
            return work(*args)
        return await asyncio.get_running_loop().run_in_executor(self._workers, work, *args)

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)

    def _prompt(self, request: GenerationRequest) -> str | list[int]:
        if request.messages is None:
            assert request.prompt is not None
            if isinstance(request.prompt, str) and len(request.prompt) > OFF_LOOP_CHARS:
                return self.engine.tokenizer.encode(request.prompt)  # here, not on the loop
            return request.prompt
        try:
            return self.engine.apply_chat_template(
                request.messages,
                tools=request.tools,
                chat_template_kwargs=request.chat_template_kwargs,
            )
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
        )


def _chars(request: GenerationRequest) -> int:
    """A cheap size estimate of what preparing the request will chew through."""
    if request.messages is not None:
        return sum(len(str(m.get("content", ""))) for m in request.messages)
    return len(request.prompt) if isinstance(request.prompt, str) else 0
