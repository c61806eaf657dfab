"""kvgate's embedded inference engine: paged KV cache, prefix caching, continuous batching.

from engine import LLM, SamplingParams
LLM().generate("Hello", SamplingParams(max_tokens=16, temperature=0))
"""

from engine.async_llm import AsyncLLM, RequestStream
from engine.config import EngineConfig
from engine.errors import AdmissionRefused, EngineOverloaded, EngineStepError, EngineUnavailable
from engine.llm import LLM
from engine.outputs import OutputKind, RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutputs
from engine.stats import EngineStats, ReplicaStats

__all__ = [
    "LLM",
    "AdmissionRefused",
    "AsyncLLM",
    "EngineConfig",
    "EngineOverloaded",
    "EngineStats",
    "EngineStepError",
    "EngineUnavailable",
    "OutputKind",
    "ReplicaStats",
    "RequestOutput",
    "RequestStream",
    "SamplingParams",
    "StructuredOutputs",
]
