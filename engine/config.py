"""Everything that shapes an engine instance, validated once so a typo fails at startup."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
}


@dataclass
class EngineConfig:
    model: str | None = None  # a Hugging Face folder; None = the built-in tiny model
    dtype: str = "auto"  # auto | float32 | bfloat16
    kv_cache_dtype: str = "auto"  # auto | float32 | bfloat16 | fp8
    kv_cache_memory: int | str | None = None  # bytes ("256MiB" too); None = a share of free memory
    kv_cache_memory_fraction: float = 0.1  # of free memory, when kv_cache_memory is None
    enable_prefix_caching: bool = True
    replicas: int = 1
    seed: int = 0  # seeds requests whose SamplingParams.seed is None (in arrival order)
    attention_backend: str = "auto"
    routing: str = "prefix"  # prefix | round_robin | random (baselines), for replicas > 1
    device: str = "auto"  # auto = cuda when available, else cpu
    max_model_len: int | None = None  # None = the model's context length
    max_num_seqs: int = 64  # running requests per replica
    max_num_batched_tokens: int = 2048  # tokens computed per replica step
    free_block_reserve: int | None = None  # admission keeps this many blocks free; None = 2%
    conversation_cache_share: float = 0.5  # most of the pool one request may hold or keep cached
    # Admission (AsyncLLM): beyond these a request is refused at once instead of queued.
    max_waiting: int = 256  # requests queued, not yet running, per replica (total: x replicas)
    max_prompt_tokens: int | None = None  # None = only max_model_len bounds a prompt
    max_tokens_limit: int | None = None  # largest SamplingParams.max_tokens; None = no cap
    step_timeout_s: float = 120.0  # a step running longer marks its replica stalled

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError("max_num_batched_tokens must be >= max_num_seqs")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
        if not 0.0 < self.conversation_cache_share <= 1.0:
            raise ValueError("conversation_cache_share must be in (0, 1]")
        if self.free_block_reserve is not None and self.free_block_reserve < 0:
            raise ValueError("free_block_reserve must be >= 0")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        for name in ("max_prompt_tokens", "max_tokens_limit"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.step_timeout_s <= 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)


def parse_bytes(value: int | str) -> int:
    """``268435456``, ``"256MiB"``, ``"1.5 GB"`` -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"kv_cache_memory: cannot read {value!r} as a size like '256MiB'")
        number = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if number <= 0:
        raise ValueError(f"kv_cache_memory must be > 0, got {value!r}")
    return number


def free_memory_bytes(device_type: str) -> int:
    """Memory free on the device now: CUDA asks the driver, CPU reads MemAvailable."""
    if device_type == "cuda":
        import torch

        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
