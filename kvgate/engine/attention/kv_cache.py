"""Paged KV cache storage: layout, dtypes, the fp8 scheme, and sizing from a byte budget.

Per layer, K and V are ``[num_blocks, num_kv_heads, block_size, head_dim]`` in the cache
dtype. For fp8 (``float8_e4m3fn``) each token of each KV head carries an fp32 scale
``amax / 448`` so no calibration is needed and a cached block never goes stale. Values are
clamped to ±448 before the cast: a plain cast does not saturate, it yields NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
# Smallest scale, so an all-zero token quantizes to zeros instead of 0/0.
FP8_MIN_SCALE = 1e-12
# Mixed into the root block hash: blocks written under another scheme must never match.
FP8_SCALE_SCHEME = "e4m3fn/per-token-per-kv-head/amax-448"

_DTYPE_NAMES = {
    "fp8": FP8_DTYPE,
    "fp8_e4m3": FP8_DTYPE,
    "float8_e4m3fn": FP8_DTYPE,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
CACHE_DTYPES = frozenset(_DTYPE_NAMES.values())


def resolve_cache_dtype(name: str | torch.dtype, model_dtype: torch.dtype) -> torch.dtype:
    """``"auto"`` follows the model dtype; names like ``"fp8"``/``"bf16"`` map to torch dtypes."""
    if isinstance(name, torch.dtype):
        dtype = name
    elif name == "auto":
        dtype = model_dtype
    elif name in _DTYPE_NAMES:
        dtype = _DTYPE_NAMES[name]
    else:
        raise ValueError(f"kv_cache_dtype: unknown cache dtype {name!r}")
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: unsupported cache dtype {dtype}")
    return dtype


def cache_scheme(dtype: torch.dtype) -> str:
    """Identity of the stored representation, for the root block hash."""
    return FP8_SCALE_SCHEME if dtype == FP8_DTYPE else str(dtype).removeprefix("torch.")


@dataclass
class KVCache:
    k: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_dim]
    v: torch.Tensor
    k_scale: torch.Tensor | None = None  # fp32 [num_blocks, num_kv_heads, block_size] for fp8
    v_scale: torch.Tensor | None = None

    @property
    def is_fp8(self) -> bool:
        return self.k.dtype == FP8_DTYPE

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    def kernel_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fp8 scales; without them K and V stand in, never read (a Triton kernel takes a
        tensor in every pointer argument)."""
        if self.k_scale is None or self.v_scale is None:
            return self.k, self.v
        return self.k_scale, self.v_scale


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype
) -> int:
    """Bytes one cached token costs across all layers, K and V, scales included."""
    per_head = head_dim * cache_dtype.itemsize
    if cache_dtype == FP8_DTYPE:
        per_head += torch.float32.itemsize
    return 2 * num_layers * num_kv_heads * per_head


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
    cache_dtype: torch.dtype,
    device: torch.device | str,
) -> list[KVCache]:
    """Zero-filled caches, one per layer (zeros keep padding reads finite)."""
    if cache_dtype not in CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: unsupported cache dtype {cache_dtype}")
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    caches = []
    for _ in range(num_layers):
        scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if cache_dtype == FP8_DTYPE:
            scales = tuple(  # type: ignore[assignment]
                torch.ones(shape[:3], dtype=torch.float32, device=device) for _ in range(2)
            )
        k = torch.zeros(shape, dtype=cache_dtype, device=device)
        v = torch.zeros(shape, dtype=cache_dtype, device=device)
        caches.append(KVCache(k, v, *scales))
    return caches


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (fp8 values, fp32 scale ``[...]``) with one scale per vector."""
    x = x.float()
    scale = (x.abs().amax(dim=-1) / FP8_MAX).clamp_min(FP8_MIN_SCALE)
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8` (up to rounding), in fp32."""
    return q.float() * scale.unsqueeze(-1)
