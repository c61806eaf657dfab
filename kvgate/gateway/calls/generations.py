"""What the doors hold to run generations: the one place a backend is called.

``Generations.start`` salts a request with the caller's tenant (never another tenant's cached
blocks), reads its function calls (``kvgate.gateway.function_calls.reading``), meters its tokens
against the tenant's budget, and translates what the backend raises — bad input, a refusal,
a failed step, a broken upstream — into ``kvgate.gateway.calls.errors``, so a door neither knows
which backend ran the call nor catches an engine's or an upstream's exceptions.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any, TypeVar

from kvgate.engine.errors import (
    AdapterError,
    AdapterNotFound,
    AdmissionRefused,
    EngineStepError,
    InvalidArgument,
    UnknownAdapter,
)
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.tokenization.tokenizer import Tokenizer
from kvgate.gateway.auth.budgets import Budgets
from kvgate.gateway.auth.identity import current as current_identity
from kvgate.gateway.auth.identity import tenant_salt
from kvgate.gateway.calls.errors import BadInput, GenerationFailed, NotFound, Refused
from kvgate.gateway.function_calls.formats import DEFAULT as DEFAULT_FAMILY
from kvgate.gateway.function_calls.formats import Family
from kvgate.gateway.function_calls.reading import FunctionCalling
from kvgate.gateway.generation import (
    Adapter,
    Backend,
    Completion,
    Embeddings,
    EmbeddingsRequest,
    GenerationRequest,
    Guarded,
    Stream,
    TextDelta,
    Tokenized,
    TokenizeRequest,
)
from kvgate.gateway.ops import access_log, tracing
from kvgate.gateway.reasoning.parser import ReasoningFormat
from kvgate.gateway.reasoning.reading import Reasoning

T = TypeVar("T")
CHARGE_EVERY = 16  # completion tokens debited in batches of this many (and at the end)


class Generations:
    def __init__(
        self,
        backend: Backend,
        budgets: Budgets,
        tool_family: Family = DEFAULT_FAMILY,
        reasoning: ReasoningFormat | None = None,
    ) -> None:
        self.backend = backend
        self.budgets = budgets
        self.model_name = backend.model_name
        self.max_model_len = backend.max_model_len
        # How this model writes function calls; None where the backend reads them itself.
        self._family = None if backend.reads_tool_calls else tool_family
        # How it writes its thinking (--reasoning-parser); a fleet's upstreams split their own.
        self._reasoning = (
            None if backend.reads_tool_calls or not reasoning else Reasoning(reasoning)
        )

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.backend.tokenizer

    def sampling_params(
        self, fields: dict[str, Any], defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        """``SamplingParams`` from a request's fields; the door's ``defaults``, then the
        model's generation_config.json ones, fill those it leaves unset (BadInput naming a bad
        field). Only the request's own fields count as given (what a fleet sends upstream)."""
        try:
            merged = {**self.backend.default_sampling_fields, **(defaults or {})}
            return SamplingParams.from_dict(fields, defaults=merged)
        except ValueError as exc:
            raise _bad_input(exc) from None

    async def start(self, request: GenerationRequest) -> Stream:
        """Prepare and admit ``request``: BadInput or Refused if not (nothing was queued);
        its stream may end in GenerationFailed."""
        calling = None
        if request.functions is not None:
            calling = FunctionCalling(request.functions, self._family)
            request = replace(request, params=calling.constrain(request.params))
        reasoning = self._reasoning if request.messages is not None else None  # chats only
        if reasoning is not None:
            request = replace(request, params=reasoning.constrain(request.params))
        salt = tenant_salt(request.cache_salt)
        if salt != request.cache_salt:  # no tenant (auth off): the request as it came
            request = replace(request, cache_salt=salt)
        try:
            source = await self.backend.start(request)
        except ValueError as exc:
            raise _bad_input(exc) from None
        except AdmissionRefused as exc:
            raise _refused(exc) from None
        items: Stream = _translated(source)
        if reasoning is not None:  # the calls are read from what follows the thinking
            items = reasoning.read(items)
        if calling is not None:
            items = calling.read(items)
        identity = current_identity()
        if identity is not None and self.budgets.tokens_per_min:
            items = metered(items, self.budgets, identity.tenant)
        record = access_log.current()
        if record is not None:
            items = access_log.counted(items, record)
        return Guarded(tracing.counted(items, request), source)

    async def tokenize(self, request: TokenizeRequest) -> Tokenized:
        """Token ids (BadInput when it cannot fit the context or a template refuses it)."""
        try:
            return await self.backend.tokenize(request)
        except ValueError as exc:
            raise _bad_input(
                exc, "messages" if request.messages is not None else "prompt"
            ) from None
        except AdmissionRefused as exc:
            raise _refused(exc) from None

    async def prompt_ids(self, request: GenerationRequest, field: str) -> list[int]:
        """The token ids ``request`` would prefill (BadInput where its call would refuse its
        prompt, naming ``field``, the door's name for the prompt, unless the error names
        one)."""
        try:
            return await self.backend.prompt_ids(request)
        except ValueError as exc:
            raise _bad_input(exc, field) from None
        except AdmissionRefused as exc:
            raise _refused(exc) from None

    async def embed(self, request: EmbeddingsRequest) -> Embeddings:
        """Every input's embedding, salted with the tenant and its prompt tokens debited from
        the tenant's budget: BadInput naming ``input``, Refused, or GenerationFailed."""
        request = replace(request, cache_salt=tenant_salt(request.cache_salt))
        try:
            result = await self.backend.embed(request)
        except ValueError as exc:
            raise _bad_input(exc, "input") from None
        except AdmissionRefused as exc:
            raise _refused(exc) from None
        except EngineStepError as exc:
            raise GenerationFailed(str(exc)) from exc
        identity = current_identity()
        if identity is not None:
            await self.budgets.settle(identity.tenant, result.prompt_tokens)
        record = access_log.current()
        if record is not None:
            record.prompt_tokens += result.prompt_tokens
        tracing.count_input(result.prompt_tokens)
        return result

    def adapters(self) -> list[Adapter] | None:
        """The LoRA adapters served (None: a fleet, whose upstreams know theirs)."""
        return self.backend.adapters()

    async def load_adapter(self, name: str, path: str, replace: bool = False) -> None:
        """NotFound (no adapter at ``path``) or BadInput (one that cannot be served)."""
        try:
            await self.backend.load_adapter(name, path, replace)
        except AdapterNotFound as exc:
            raise NotFound(str(exc), "lora_path") from None
        except AdapterError as exc:
            raise BadInput(str(exc), "lora_path") from None

    async def unload_adapter(self, name: str) -> None:
        """NotFound when no adapter of that name is loaded."""
        try:
            removed = await self.backend.unload_adapter(name)
        except AdapterError as exc:
            raise BadInput(str(exc), "lora_name") from None
        if not removed:
            raise NotFound(f"The lora adapter '{name}' cannot be found.", "lora_name")

    async def off_loop(self, size: int, work: Callable[..., T], *args: Any) -> T:
        """Work for a door (parsing, validating a large body) on the backend's worker pool
        when it is large."""
        return await self.backend.off_loop.run(size, work, *args)


def _refused(exc: AdmissionRefused) -> Refused:
    return Refused(503, exc.reason, f"Server overloaded: {exc}", exc.retry_after_s)


def _bad_input(exc: ValueError, field: str | None = None) -> BadInput:
    if isinstance(exc, UnknownAdapter):
        return NotFound(str(exc), "model")
    return BadInput(str(exc), exc.field if isinstance(exc, InvalidArgument) else field)


async def _translated(source: Stream) -> AsyncGenerator[TextDelta | Completion]:
    """The backend's items; a failed engine step becomes GenerationFailed (an upstream's
    failure already is one)."""
    async with aclosing(source):
        try:
            async for item in source:
                yield item
        except EngineStepError as exc:
            raise GenerationFailed(str(exc)) from exc


async def metered(
    items: Stream, budgets: Budgets, tenant: str
) -> AsyncGenerator[TextDelta | Completion]:
    """Debit the tenant as tokens are produced: completion tokens in batches, the rest and
    the prompt before the answer goes; what a call cut short produced when it is closed."""
    owed = 0
    try:
        async with aclosing(items):
            async for item in items:
                if isinstance(item, TextDelta):
                    owed += len(item.token_ids)
                    if owed >= CHARGE_EVERY:
                        budgets.charge(tenant, owed)
                        owed = 0
                else:
                    cost, owed = owed + item.prompt_tokens, 0
                    await budgets.settle(tenant, cost)
                yield item
    finally:
        budgets.charge(tenant, owed)
