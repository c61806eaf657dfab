"""The asyncio face of the engine, used by the HTTP gateway.

Each replica steps in its own thread; a request's token deltas cross into the event loop
through its ``OutputCollector`` (merged while the reader is behind: O(1) buffered items), and
are detokenized and checked for stop strings in the reader's task (``OutputProcessor``), not
on the step thread. ``submit`` admits a request at once and returns its ``RequestStream``;
closing the stream — ``aclose()``, ``aclosing``, a cancelled task — aborts the request at the
next step boundary and frees its KV blocks. ``embed`` runs an embedding request on the same
replicas (a prefill that returns its pooled vector): cancelling it aborts it the same way.

Admission: a request is placed only on a replica that is stepping and has fewer than
``max_waiting`` requests waiting; otherwise ``submit`` raises AdmissionRefused at once
(nothing queued), so a burst meets a clear refusal instead of an ever longer queue.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from kvgate.engine.config import EngineConfig
from kvgate.engine.core.engine_core import EngineCore
from kvgate.engine.core.prompt_rules import Prompt
from kvgate.engine.core.replica import Replica
from kvgate.engine.core.request import Request
from kvgate.engine.core.stat_logger import started
from kvgate.engine.errors import EngineStepError
from kvgate.engine.models.lora import LoRAAdapter
from kvgate.engine.output_processor import OutputCollector, OutputProcessor, OutputStream
from kvgate.engine.outputs import EmbeddingOutput, RequestOutput, StepOutput
from kvgate.engine.process.kv_publisher import start_publisher
from kvgate.engine.request_options import DEFAULT_OPTIONS, RequestOptions
from kvgate.engine.sampling_params import SamplingParams, StructuredOutputs
from kvgate.engine.stats import EngineStats
from kvgate.engine.tokenization.tokenizer import Tokenizer


class RequestStream(OutputStream):
    """The outputs of one admitted request (admitted at ``submit``); ``aclose`` aborts it."""

    def __init__(
        self,
        engine: AsyncLLM,
        request: Request,
        replica: Replica,
        collector: OutputCollector,
        processor: OutputProcessor,
    ) -> None:
        super().__init__(request.request_id, collector, processor)
        self._engine, self._request, self._replica = engine, request, replica

    @property
    def replica(self) -> int:
        return self._replica.index

    def _release(self, abort: bool, reason: str) -> None:
        self._engine._forget(self._request)
        if abort:
            self._replica.abort(self._request, reason)

    def _step_error(self, exc: Exception) -> Exception:
        return _engine_error(self._replica, exc)


def _engine_error(replica: Replica, exc: Exception) -> EngineStepError:
    """Whatever failed the step computing a request, its reader gets one error type."""
    return EngineStepError(f"engine replica {replica.index}: {exc}")


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, **options: Any):
        """Load the model and start one step thread per replica. ``options`` build an
        EngineConfig when none is given."""
        self.config = config if config is not None else EngineConfig(**options)
        self._collectors: dict[str, OutputCollector] = {}
        self._lock = threading.Lock()
        self.core = EngineCore(self.config, on_output=self._deliver)
        self.kv_events = start_publisher(self.config.kv_events_config, self.core.pool)
        self._closed = False
        for replica in self.core.replicas:
            replica.start()
        self._stat_logger = started(self.core.stats, self.config.stats_interval_s)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.core.tokenizer

    @property
    def model_name(self) -> str:
        return self.core.model_name

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def default_sampling_fields(self) -> dict[str, Any]:
        """The model's generation_config.json sampling defaults (temperature, top_p, top_k):
        pass them as ``SamplingParams.from_dict(fields, defaults=...)`` for unset fields."""
        return dict(self.core.model_config.generation_defaults)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        documents: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the conversation with the assistant's turn opened; ``tools``,
        ``documents`` and ``chat_template_kwargs`` as for ``LLM.chat``. A rendered
        conversation too long to fit is refused as ``encode_prompt`` refuses a prompt."""
        text = self.core.tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=True,
            tools=tools,
            documents=documents,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.core.encode_prompt(text, add_special_tokens=False)

    def checked_prompt(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids (a text tokenized; a worker thread may call it), checked as
        ``submit`` checks them: ids in the vocabulary, at most ``max_prompt_len`` (a text whose
        length alone shows it cannot fit is refused, ``TooManyTokens``, without tokenizing it),
        so a prompt checked here is one ``submit`` takes."""
        return self.core.prompts.checked_prompt(prompt)

    def encode_embedding_input(self, prompt: Prompt) -> list[int]:
        """An embedding input's token ids, checked as ``embed`` checks them (a worker thread
        may call it: a large text is tokenized off the event loop)."""
        return self.core.embedding_ids(prompt)

    def grammar_compiled(self, spec: StructuredOutputs) -> bool:
        """Whether ``submit`` would find ``spec`` compiled (else compile it off the loop)."""
        return self.core.grammars.cached(spec)

    def compile_grammar(self, spec: StructuredOutputs) -> None:
        """Compile ``spec`` into the grammar cache (ValueError naming the field if bad). Safe
        from any thread: a front door runs it on a worker before ``submit``, so a large schema
        never stalls its event loop."""
        self.core.grammars.compile(spec)

    def add_lora(self, name: str, path: str, replace: bool = False) -> LoRAAdapter:
        """Load a PEFT adapter (``kvgate.engine.models.lora.AdapterError`` if it cannot be served): reads
        and checks its files, so a front door calls it on a worker thread."""
        return self.core.add_lora(name, path, replace)

    def remove_lora(self, name: str) -> bool:
        return self.core.remove_lora(name)

    def list_loras(self) -> list[LoRAAdapter]:
        return self.core.loras.list()

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> RequestStream:
        """Admit a request now (call from the event loop) and return its output stream.
        ``options``: its routing key, tenant salt, adapter and output form. Raises ValueError
        for bad input (``UnknownAdapter`` for an adapter not loaded) and AdmissionRefused when
        no replica can take it, both before anything is queued; the stream raises
        EngineStepError if the step computing it fails."""
        if self._closed:
            raise RuntimeError("the engine has been shut down")
        request = self.core.make_request(
            prompt, params, options.cache_key, options.cache_salt, options.lora_name
        )
        replica, collector = self._enqueue(request)
        processor = OutputProcessor(
            request.request_id, request.prompt_token_ids, params, self.core.tokenizer, options.kind
        )
        return RequestStream(self, request, replica, collector, processor)

    async def embed(
        self, prompt: Prompt, cache_key: str | None = None, cache_salt: str | None = None
    ) -> EmbeddingOutput:
        """The prompt's embedding: its last token's final hidden state, L2-normalized. The
        request is scheduled as a prefill beside generations (batched with them, within the
        KV budget, reusing cached prefix blocks). Raises ValueError or AdmissionRefused before
        anything is queued, EngineStepError if its step failed; cancelling it aborts it."""
        if self._closed:
            raise RuntimeError("the engine has been shut down")
        request = self.core.make_embedding_request(prompt, cache_key, cache_salt)
        replica, collector = self._enqueue(request)
        try:
            step = await collector.get()
        except Exception as exc:  # the step computing it failed: its blocks are freed
            raise _engine_error(replica, exc) from exc
        finally:
            self._forget(request)
            if not request.finished:  # cancelled while waiting
                replica.abort(request)
        assert step.embedding is not None
        return EmbeddingOutput(
            request.request_id,
            request.prompt_token_ids,
            step.embedding,
            step.cached_tokens,
            step.replica,
        )

    def _enqueue(self, request: Request) -> tuple[Replica, OutputCollector]:
        """Admit ``request`` on a replica and register the collector its outputs go to."""
        replica = self.core.admit(request)
        collector = OutputCollector(asyncio.get_running_loop())
        with self._lock:
            self._collectors[request.request_id] = collector
        try:
            replica.submit(request)  # refuses if the replica died since admit chose it
        except BaseException:
            self._forget(request)
            raise
        return replica, collector

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> AsyncIterator[RequestOutput]:
        """``submit`` as an async generator (admission happens at the first ``anext``)."""
        stream = self.submit(prompt, params, options)
        try:
            async for output in stream:
                yield output
        finally:
            await stream.aclose()

    def _deliver(self, request: Request, item: StepOutput | BaseException) -> None:
        """Runs on a replica's step thread."""
        with self._lock:
            collector = self._collectors.get(request.request_id)
        if collector is not None:
            collector.put(item)

    def _forget(self, request: Request) -> None:
        with self._lock:
            self._collectors.pop(request.request_id, None)

    def stats(self) -> EngineStats:
        return self.core.stats()

    def replicas_ready(self) -> list[bool]:
        """Per replica: stepping (not stalled past ``step_timeout_s``, not failed)."""
        return [r.available for r in self.core.replicas]

    def is_ready(self) -> bool:
        return not self._closed and all(self.replicas_ready())

    def shutdown(self) -> None:
        """Stop the step threads (idempotent)."""
        self._closed = True
        if self._stat_logger is not None:
            self._stat_logger.stop()
            self._stat_logger = None
        for replica in self.core.replicas:
            replica.stop()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        with self._lock:
            collectors = list(self._collectors.values())
        for collector in collectors:
            collector.put(RuntimeError("engine shut down"))
