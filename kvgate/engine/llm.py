"""Offline batch inference, shaped like vLLM's ``LLM``:

    llm = LLM(dtype="float32")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=8, temperature=0))

Replicas are stepped by hand in the caller's thread until every request has finished; each
request's outputs go through its own ``OutputProcessor`` (detokenizing, stop strings), as on
the async path. A failed step raises ``EngineStepError`` instead of returning partial text.
``embed`` runs embedding requests on the same engine (vLLM needs a separate pooling runner).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from kvgate.engine.config import EngineConfig
from kvgate.engine.core.engine_core import EngineCore
from kvgate.engine.core.prompt_rules import Prompt
from kvgate.engine.core.request import Request
from kvgate.engine.errors import EngineStepError
from kvgate.engine.models.lora import LoRARequest
from kvgate.engine.output_processor import OutputProcessor
from kvgate.engine.outputs import EmbeddingOutput, OutputKind, RequestOutput, StepOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.stats import EngineStats

Message = dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str | None = None,
        dtype: str = "auto",
        kv_cache_dtype: str = "auto",
        kv_cache_memory: int | str | None = None,
        enable_prefix_caching: bool = True,
        replicas: int = 1,
        seed: int = 0,
        **options: Any,
    ):
        """``options`` are further EngineConfig fields (max_num_seqs, device, ...)."""
        self.config = EngineConfig(
            model=model,
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_memory=kv_cache_memory,
            enable_prefix_caching=enable_prefix_caching,
            replicas=replicas,
            seed=seed,
            **options,
        )
        self._processors: dict[str, OutputProcessor] = {}
        self._results: dict[str, RequestOutput | EmbeddingOutput | BaseException] = {}
        self.core = EngineCore(self.config, on_output=self._on_output)
        self.tokenizer = self.core.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in order. ``lora_request`` (one for all, or one
        per prompt; None is the base model) loads an adapter not loaded yet (``enable_lora``).
        All inputs are validated before any request is queued; EngineStepError if a step
        computing one of them failed."""
        batch = _prompt_list(prompts)
        params = self.get_default_sampling_params() if params is None else params
        if isinstance(params, SamplingParams):
            params = [params] * len(batch)
        if len(params) != len(batch):
            raise ValueError(f"params: {len(params)} given for {len(batch)} prompts")
        loras = self._adapter_names(lora_request, len(batch))
        requests = [
            self.core.make_request(p, sp, lora_name=name)
            for p, sp, name in zip(batch, params, loras, strict=True)
        ]
        for request in requests:
            self._processors[request.request_id] = OutputProcessor(
                request.request_id,
                request.prompt_token_ids,
                request.params,
                self.tokenizer,
                OutputKind.FINAL_ONLY,
            )
        return self._run(requests)  # type: ignore[return-value]

    def embed(self, prompts: Prompt | Sequence[Prompt]) -> list[EmbeddingOutput]:
        """One embedding per prompt, in order: each prompt's last-token final hidden state,
        L2-normalized, computed by the same engine that generates (batched like prefills)."""
        requests = [self.core.make_embedding_request(p) for p in _prompt_list(prompts)]
        return self._run(requests)  # type: ignore[return-value]

    def _run(self, requests: list[Request]) -> list[RequestOutput | EmbeddingOutput]:
        """Step until every request has its result; EngineStepError if one failed."""
        for request in requests:
            self.core.choose_replica(request).submit(request)
        try:
            # Until every request has its result and the aborts of those a stop string ended
            # have been applied (their blocks freed).
            while any(r.request_id not in self._results for r in requests) or any(
                replica.has_work() for replica in self.core.replicas
            ):
                for replica in self.core.replicas:
                    if replica.has_work():
                        replica.step()
            results = [self._results[r.request_id] for r in requests]
        finally:
            for request in requests:
                self._processors.pop(request.request_id, None)
                self._results.pop(request.request_id, None)
        failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:  # as vLLM's LLM does, rather than return partial text; the others finished
            cause = results[failed[0]]
            raise EngineStepError(f"prompts {failed}: {cause}") from cause  # type: ignore[misc]
        return results  # type: ignore[return-value]

    def _adapter_names(
        self, lora: LoRARequest | Sequence[LoRARequest | None] | None, count: int
    ) -> list[str | None]:
        """Each prompt's adapter name, loading the adapters not loaded yet."""
        each = [lora] * count if lora is None or isinstance(lora, LoRARequest) else list(lora)
        if len(each) != count:
            raise ValueError(f"lora_request: {len(each)} given for {count} prompts")
        for request in each:
            if request is not None and request.lora_name not in self.core.loras:
                self.core.add_lora(request.lora_name, request.lora_path)
        return [None if r is None else r.lora_name for r in each]

    def _on_output(self, request: Request, item: StepOutput | BaseException) -> None:
        """Runs in this thread, inside ``replica.step``."""
        if request.pooling and isinstance(item, StepOutput):
            assert item.embedding is not None
            self._results[request.request_id] = EmbeddingOutput(
                request.request_id,
                request.prompt_token_ids,
                item.embedding,
                item.cached_tokens,
                item.replica,
            )
            return
        processor = self._processors.get(request.request_id)
        if request.request_id in self._results or (processor is None and not request.pooling):
            return
        if isinstance(item, BaseException):
            self._results[request.request_id] = item
            return
        assert processor is not None
        output = processor.process(item)
        if processor.stopped and not item.finished:
            self.core.replicas[request.replica].abort(request, "stop")
        if output is not None:
            self._results[request.request_id] = output

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        documents: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate.
        ``tools`` (JSON schemas), ``documents`` and ``chat_template_kwargs`` (e.g.
        ``{"enable_thinking": False}``) reach the template as transformers passes them."""
        conversations = cast(
            Sequence[Sequence[Message]],
            [messages] if messages and isinstance(messages[0], dict) else messages,
        )
        prompts: list[Prompt] = [
            self.core.tokenizer.encode_chat(
                list(c), tools=tools, documents=documents, chat_template_kwargs=chat_template_kwargs
            )
            for c in conversations
        ]
        return self.generate(prompts, params)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (temperature,
        top_p, top_k), as vLLM applies them; used when ``generate`` gets no params."""
        return SamplingParams.from_dict({}, self.core.model_config.generation_defaults)

    def stats(self) -> EngineStats:
        return self.core.stats()


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str) or (
        isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
    ):
        return [cast(Prompt, prompts)]  # a single prompt (text or token ids)
    return list(cast(Sequence[Prompt], prompts))
