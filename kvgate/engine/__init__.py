"""kvgate's embedded inference engine: paged KV cache, prefix caching, continuous batching.

from kvgate.engine import LLM, SamplingParams
LLM().generate("Hello", SamplingParams(max_tokens=16, temperature=0))

The names below load their modules on first use (``kvgate.engine._lazy``): importing a light
submodule (``kvgate.engine.sampling_params``, ``kvgate.engine.errors``, ``kvgate.engine.tokenization.tokenizer``, ...) or a
light name (``from kvgate.engine import SamplingParams``) does not import torch.
"""

import typing

import kvgate.engine._lazy as _lazy
import kvgate.engine.memory as _memory

_memory.prepare()  # before any large allocation: see kvgate/engine/memory.py

if typing.TYPE_CHECKING:
    from kvgate.engine.async_llm import AsyncLLM, RequestStream
    from kvgate.engine.config import EngineConfig
    from kvgate.engine.errors import (
        AdmissionRefused,
        EngineOverloaded,
        EngineStepError,
        EngineUnavailable,
    )
    from kvgate.engine.llm import LLM
    from kvgate.engine.outputs import EmbeddingOutput, OutputKind, RequestOutput
    from kvgate.engine.request_options import RequestOptions
    from kvgate.engine.sampling_params import SamplingParams, StructuredOutputs
    from kvgate.engine.stats import EngineStats, ReplicaStats

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
        "kvgate.engine.async_llm": ("AsyncLLM", "RequestStream"),
        "kvgate.engine.config": ("EngineConfig",),
        "kvgate.engine.errors": (
            "AdmissionRefused",
            "EngineOverloaded",
            "EngineStepError",
            "EngineUnavailable",
        ),
        "kvgate.engine.llm": ("LLM",),
        "kvgate.engine.outputs": ("EmbeddingOutput", "OutputKind", "RequestOutput"),
        "kvgate.engine.request_options": ("RequestOptions",),
        "kvgate.engine.sampling_params": ("SamplingParams", "StructuredOutputs"),
        "kvgate.engine.stats": ("EngineStats", "ReplicaStats"),
    },
)
