"""``kv_write``: store new K/V into their cache slots, quantizing to fp8 on the way.

One program per (token, KV head): load the head vector, and for fp8 compute its scale
``amax / 448`` (floored at ``FP8_MIN_SCALE``), clamp to ±448 and round, then scatter to
``block * stride + offset``. Offsets are int64 (large caches overflow int32); slots < 0 are
padding and leave the cache untouched. Reference: ``kvgate.engine.attention.torch_backend.write_kv``.
"""

import torch
import triton
import triton.language as tl

from kvgate.engine.attention.kv_cache import FP8_MAX, FP8_MIN_SCALE, KVCache
from kvgate.engine.attention.triton.fp8 import round_to_e4m3


@triton.jit
def _store_head(
    src_ptr, src_off, dst_ptr, dst_off, scale_ptr, scale_off, d, d_mask, valid,
    FP8: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
):  # fmt: skip
    x = tl.load(src_ptr + src_off + d, mask=d_mask, other=0.0).to(tl.float32)
    if FP8:
        scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX, MIN_SCALE)
        x = round_to_e4m3(tl.clamp(x / scale, -FP8_MAX, FP8_MAX))
        tl.store(scale_ptr + scale_off, scale, mask=valid)
    tl.store(dst_ptr + dst_off + d, x.to(dst_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _kv_write_kernel(
    k_ptr, v_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ch, stride_cs, stride_sb, stride_sh,
    block_size, head_dim,
    D_PAD: tl.constexpr, FP8: tl.constexpr, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    block, offset = slot // block_size, slot % block_size
    d = tl.arange(0, D_PAD)
    d_mask = d < tl.where(valid, head_dim, 0)  # a skipped slot moves no element
    dst = block * stride_cb + head * stride_ch + offset * stride_cs
    scale_dst = block * stride_sb + head * stride_sh + offset
    _store_head(k_ptr, token * stride_kt + head * stride_kh, k_cache_ptr, dst, k_scale_ptr,
                scale_dst, d, d_mask, valid, FP8, FP8_MAX, MIN_SCALE)  # fmt: skip
    _store_head(v_ptr, token * stride_vt + head * stride_vh, v_cache_ptr, dst, v_scale_ptr,
                scale_dst, d, d_mask, valid, FP8, FP8_MAX, MIN_SCALE)  # fmt: skip


def kv_write(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter ``k``/``v`` ``[T, Hkv, D]`` into ``cache`` by ``slot_mapping [T]`` (int64)."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    assert cache.k.stride() == cache.v.stride() and cache.k.stride(-1) == 1
    fp8 = cache.k_scale is not None
    scales = cache.kernel_scales()
    _kv_write_kernel[(num_tokens, kv_heads)](
        k, v, slot_mapping.to(torch.int64), cache.k, cache.v, *scales,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cache.k.stride(0), cache.k.stride(1), cache.k.stride(2),
        scales[0].stride(0), scales[0].stride(1),
        cache.block_size, head_dim,
        D_PAD=triton.next_power_of_2(head_dim), FP8=fp8, FP8_MAX=FP8_MAX, MIN_SCALE=FP8_MIN_SCALE,
    )  # fmt: skip
