"""Everything that shapes an engine instance, validated once so a typo fails at startup."""

from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate.engine.native_variants import read_cpu_flags
from kvgate.engine.spec_decode.config import SpeculativeConfig

log = logging.getLogger(__name__)

CACHE_ENV = "KVGATE_CACHE_DIR"  # where built things live: tiny models, compiled CPU kernels

# CPU feature flags (/proc/cpuinfo) meaning bf16 arithmetic runs in hardware: x86 AVX-512 BF16
# or AMX, Arm's BF16 extension. Without them oneDNN emulates bf16 with fp32 instructions plus
# conversions, which is slower than plain fp32.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")

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
TINY_MODEL = "tiny"  # the random test model's name as a `model` (kvgate.engine.loading.tiny_model)


@dataclass
class EngineConfig:
    model: str | None = None  # folder, .gguf file, tiny, fetchable name or Hub id; None = tiny
    revision: str | None = None  # of a Hub id: branch, tag or commit (None = main)
    dtype: str = "auto"  # auto | float32 | bfloat16 (auto: see choose_dtype)
    gguf_dequantize: bool = False  # a GGUF's quantized weights dequantized at load (else kept)
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
    # Structured outputs (kvgate/engine/sampling/structured.py): compiled grammars kept, by their memory, and
    # the largest spec (canonical JSON bytes) compiled at all.
    grammar_cache_bytes: int | str = 256 * 2**20
    max_grammar_bytes: int | str = 128 * 2**10
    threads: int | None = None  # CPU compute threads; None = torch's setting (physical cores)
    # LoRA adapters (kvgate/engine/models/lora.py): served only when enabled; ranks up to max_lora_rank;
    # at most max_loras distinct adapters among a replica's running requests (so in a step).
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 4
    stats_interval_s: float = 0.0  # a stats log line this often while busy (stat_logger); 0: none
    # Speculative decoding (kvgate/engine/spec_decode): vLLM's --speculative-config JSON (text or
    # parsed), read into a SpeculativeConfig; None: off.
    speculative_config: SpeculativeConfig | str | dict[str, Any] | None = None
    kv_events_config: str | None = None  # vLLM's --kv-events-config JSON (process.kv_publisher)

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
        for name in ("max_lora_rank", "max_loras"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.stats_interval_s < 0:
            raise ValueError(f"stats_interval_s must be >= 0, got {self.stats_interval_s}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        for name in ("grammar_cache_bytes", "max_grammar_bytes"):
            setattr(self, name, parse_bytes(getattr(self, name), name))
        if isinstance(self.speculative_config, (str, dict)):
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)


def parse_bytes(value: int | str, name: str = "kv_cache_memory") -> int:
    """``268435456``, ``"256MiB"``, ``"1.5 GB"`` -> bytes (errors name ``name``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{name}: cannot read {value!r} as a size like '256MiB'")
        number = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if number <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
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


def cache_dir() -> Path:
    """kvgate's cache directory: ``$KVGATE_CACHE_DIR``, else ``~/.cache/kvgate``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvgate")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags, read once (`native_variants.read_cpu_flags`)."""
    return read_cpu_flags()


def native_bf16_flags(flags: frozenset[str] | None = None) -> list[str]:
    """The flags (of ``flags``, default this CPU's) that give hardware bf16 arithmetic."""
    flags = cpu_flags() if flags is None else flags
    return [flag for flag in NATIVE_BF16_FLAGS if flag in flags]


@dataclass(frozen=True)
class DtypeChoice:
    """A resolved dtype name ("auto" left for the checkpoint to decide) and why."""

    name: str
    reason: str


def choose_dtype(
    requested: str, device_type: str, flags: frozenset[str] | None = None
) -> DtypeChoice:
    """The compute dtype: on CPU ``auto`` is bf16 only where the CPU computes bf16 natively,
    else fp32 (emulated bf16 is slower than fp32); elsewhere ``auto`` is the checkpoint's."""
    native = native_bf16_flags(flags)
    if device_type != "cpu":
        return DtypeChoice(requested, f"{device_type}: {requested} as requested")
    if requested == "auto":
        if native:
            return DtypeChoice("bfloat16", f"auto: the CPU computes bf16 natively ({native[0]})")
        return DtypeChoice("float32", "auto: no native bf16 on this CPU (no avx512_bf16/amx_bf16)")
    if requested in ("bfloat16", "bf16") and not native:
        return DtypeChoice(
            requested,
            "bfloat16 as requested, but this CPU has no native bf16 (no avx512_bf16/amx_bf16): "
            "it is emulated and slower than float32",
        )
    return DtypeChoice(requested, f"{requested} as requested")


def choose_kv_cache_dtype(
    requested: str, model_dtype: str, device_type: str, flags: frozenset[str] | None = None
) -> DtypeChoice:
    """The KV cache dtype: ``auto`` follows the model's, except that a CPU without native bf16
    stores fp32 (attention then runs in fp32 instead of emulated bf16)."""
    if requested != "auto":
        return DtypeChoice(requested, f"{requested} as requested")
    model_dtype = model_dtype.removeprefix("torch.")
    if device_type == "cpu" and model_dtype == "bfloat16" and not native_bf16_flags(flags):
        return DtypeChoice("float32", "auto: no native bf16 on this CPU, fp32 attention")
    return DtypeChoice(model_dtype, f"auto: the model's dtype ({model_dtype})")


def log_dtype_choice(what: str, choice: DtypeChoice) -> None:
    """One startup line naming the dtype and why; a warning when bf16 will be emulated."""
    emulated = "emulated" in choice.reason
    (log.warning if emulated else log.info)("%s %s (%s)", what, choice.name, choice.reason)


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def serving_threads() -> int:
    """Compute threads when an HTTP front end shares the process: one core is left to its
    event loop whenever there are several (as vLLM's CPU backend reserves one for its
    frontend). Measured on 2 cores, tiny model, streamed chat: 1 thread gave 536 tok/s and a
    2.6 ms inter-token latency at c=1 where 2 threads gave 299 tok/s and 3.9 ms (OpenMP's
    spinning threads and the event loop fight over the cores), and 2,234 vs 1,634 tok/s at c=16."""
    return max(1, usable_cores() - 1)


def apply_threads(threads: int | None) -> int:
    """Set torch's intra-op thread count (None leaves it); returns the count in force."""
    import torch

    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def log_threads(count: int) -> None:
    log.info("threads %d (of %d usable cores)", count, usable_cores())
