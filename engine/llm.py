"""Offline batch inference, shaped like vLLM's ``LLM``:

    llm = LLM(dtype="float32")
    outs = llm.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=8, temperature=0))

Replicas are stepped by hand in the caller's thread until every request has finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.config import EngineConfig
from engine.engine_core import EngineCore, Prompt
from engine.errors import EngineStepError
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams

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
        self.core = EngineCore(self.config)
        self.tokenizer = self.core.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One finished output per prompt, in order. All inputs are validated before any
        request is queued; EngineStepError if a step computing one of them failed."""
        if isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # a single prompt (text or token ids)
        params = SamplingParams() if params is None else params
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} given for {len(prompts)} prompts")
        requests = [self.core.make_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        failed_steps = [r.num_failed_steps for r in self.core.replicas]
        for request in requests:
            self.core.choose_replica(request).submit(request)
        while any(not r.finished for r in requests):
            for replica in self.core.replicas:
                if replica.has_work():
                    replica.step()
        self._raise_for_failed_steps(requests, failed_steps)
        return [r.take_output() for r in requests]

    def _raise_for_failed_steps(self, requests: list[Request], failed_steps: list[int]) -> None:
        """A request that finished without a stop or length reason was in a step that raised
        (LLM never aborts): say so, as vLLM's LLM does, rather than return partial text.
        The other requests ran to their end first, so nothing is left queued or held."""
        failed = [i for i, r in enumerate(requests) if r.finish_reason not in ("stop", "length")]
        if not failed:
            return
        causes = [
            replica.last_step_error
            for replica, before in zip(self.core.replicas, failed_steps, strict=True)
            if replica.num_failed_steps > before
        ]
        cause = causes[0] if causes else None
        raise EngineStepError(
            f"prompts {failed}: {cause or 'the engine step computing them failed'}"
        ) from cause

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.core.tokenizer.encode_chat(list(c)) for c in conversations]
        return self.generate(prompts, params)

    def stats(self):
        return self.core.stats()
