"""kvgate's embedded inference engine: paged KV cache, prefix caching, continuous batching.

from engine import LLM, SamplingParams
LLM().generate("Hello", SamplingParams(max_tokens=16, temperature=0))

The names below load their modules on first use (``engine._lazy``): importing a light
submodule (``engine.sampling_params``, ``engine.errors``, ``engine.tokenization.tokenizer``, ...) or a
light name (``from engine import SamplingParams``) does not import torch.
"""

import typing

import engine._lazy as _lazy
import engine.memory

engine.memory.prepare()  # before any large allocation: see engine/memory.py

if typing.TYPE_CHECKING:
    from engine.async_llm import AsyncLLM, RequestStream
    from engine.config import EngineConfig
    from engine.errors import (
        AdmissionRefused,
        EngineOverloaded,
        EngineStepError,
        EngineUnavailable,
    )
    from engine.llm import LLM
    from engine.outputs import EmbeddingOutput, OutputKind, RequestOutput
    from engine.request_options import RequestOptions
    from engine.sampling_params import SamplingParams, StructuredOutputs
    from engine.stats import EngineStats, ReplicaStats

__all__ = [
    "LLM",
    "AdmissionRefused",
    "AsyncLLM",
    "EmbeddingOutput",
    "EngineConfig",
    "EngineOverloaded",
    "EngineStats",
    "EngineStepError",
    "EngineUnavailable",
    "OutputKind",
    "ReplicaStats",
    "RequestOptions",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "StructuredOutputs",
]

__getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "engine.async_llm": ("AsyncLLM", "RequestStream"),
        "engine.config": ("EngineConfig",),
        "engine.errors": (
            "AdmissionRefused",
            "EngineOverloaded",
            "EngineStepError",
            "EngineUnavailable",
        ),
        "engine.llm": ("LLM",),
        "engine.outputs": ("EmbeddingOutput", "OutputKind", "RequestOutput"),
        "engine.request_options": ("RequestOptions",),
        "engine.sampling_params": ("SamplingParams", "StructuredOutputs"),
        "engine.stats": ("EngineStats", "ReplicaStats"),
    },
)
