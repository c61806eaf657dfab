"""Native CPU attention kernels, compiled for this machine on first use.

`paged_decode.cpp` reads K/V where they lie in the paged cache, bf16, fp32 or fp8 (no gather
into a padded tensor, each byte read once, fp32 softmax): decode attention 1.6-5x faster than the torch
reference's gather + two batched matmuls on a 2-core Zen 4. It is built with the C++ compiler
torch's extensions use (``-O3 -march=native``, OpenMP for torch's thread count) into the kvgate
cache directory, once per source, torch version and CPU kind (30-45 s on 2 cores); later
processes load the build. Where nothing can be built (no compiler), or with
``KVGATE_CPU_KERNELS=0``, `load()` returns None and the torch path serves.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

from engine.attention.kv_cache import FP8_DTYPE, KVCache
from engine.config import cache_dir, cpu_flags

log = logging.getLogger(__name__)
DISABLE_ENV = "KVGATE_CPU_KERNELS"
SOURCE = Path(__file__).with_name("paged_decode.cpp")


def _cpu_kind() -> str:
    return hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8]


def _build_name() -> str:
    """A name unique to the CPU kind, the source and torch: a build never meets another
    machine's (a cache directory may be shared)."""
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(torch.__version__.encode())
    return f"kvgate_cpu_attention_{_cpu_kind()}_{digest.hexdigest()[:12]}"


def build_directory(name: str) -> Path:
    return cache_dir() / "cpu-kernels" / name


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernels (``paged_decode``), or None where they cannot be had."""
    if os.environ.get(DISABLE_ENV, "1").lower() in ("0", "false", "no", "off"):
        return None
    name = _build_name()
    directory = build_directory(name)
    try:
        from torch.utils import cpp_extension

        try:  # ninja's wheel: usable even when its venv's bin/ is not on PATH
            import ninja

            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        except ImportError:
            pass
        directory.mkdir(parents=True, exist_ok=True)
        if not any(directory.glob(f"{name}*.so")):
            log.info("building the CPU attention kernels for this machine (once, 30-45 s)")
        module = cpp_extension.load(
            name=name,
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - any build failure: the torch path serves
        log.warning("CPU attention kernels unavailable (%s); using the torch path", exc)
        return None
    _remove_stale_builds(directory)
    return module


def _remove_stale_builds(current: Path) -> None:
    """This CPU kind's earlier builds (another source or torch) are never loaded again: drop
    them. A process still running one keeps its mapped copy."""
    for other in current.parent.glob(f"kvgate_cpu_attention_{_cpu_kind()}_*"):
        if other != current:
            shutil.rmtree(other, ignore_errors=True)


class NativeDecode:
    """`paged_decode` as the torch backend's decode kernel (`torch_backend.DecodeKernel`)."""

    def __init__(self, module: ModuleType):
        self._decode = module.paged_decode
        self._head_dims = frozenset(module.head_dims())
        self._no_scales = torch.empty(0)

    def takes(self, q: torch.Tensor, cache: KVCache) -> bool:
        """bf16 or fp32 queries over a cache of the same dtype or of fp8, of a built head size."""
        return (
            q.device.type == "cpu"
            and q.dtype in (torch.bfloat16, torch.float32)
            and cache.k.dtype in (q.dtype, FP8_DTYPE)
            and q.shape[-1] in self._head_dims
        )

    def __call__(
        self, q: torch.Tensor, cache: KVCache, block_tables: torch.Tensor,
        seq_lens: torch.Tensor, scale: float, window: int | None, softcap: float | None,
    ) -> torch.Tensor:  # fmt: skip
        k_scale, v_scale = (
            (cache.k_scale, cache.v_scale) if cache.is_fp8 else (self._no_scales, self._no_scales)
        )
        return self._decode(
            q.contiguous(), cache.k, cache.v, k_scale, v_scale, block_tables, seq_lens, scale,
            window or 0, softcap or 0.0,
        )  # fmt: skip


def native_decode() -> NativeDecode | None:
    """The decode kernel for this machine, or None (see `load`)."""
    module = load()
    return None if module is None else NativeDecode(module)
