"""The small operations of a step (RMSNorm, RoPE, the K/V write, greedy argmax) as one native
call each on CPU (``kvgate/engine/csrc/kernels/cpu_ops.cpp``), with the torch formula wherever the kernel does not apply.

Why: a batch-8 decode step of bench55m on the 2-core Zen 4 spent ~24% of its single-thread
time outside the matmuls and attention, in ~25 torch ops per layer (dispatch, fresh tensors,
an ``.item()`` sync in the K/V write); and LayerNorm, the logits' fp32 copy and the argmax
each opened an OpenMP region, which under the neighbours' load waits milliseconds for the
second thread. These kernels run decode-sized inputs on the caller's thread (rows split over
torch's threads only from 64 up).

Each function returns None where its kernel cannot serve (no native library, another device or
dtype), and the caller runs its torch path.
"""

from __future__ import annotations

import torch

import kvgate.engine.native as native

_DTYPES = (torch.bfloat16, torch.float32)


def _served(*tensors: torch.Tensor) -> native.Library | None:
    """The native library's ops when every tensor is a CPU bf16/fp32 one of a single dtype.
    Kept to attribute reads: it runs several times a layer (``Tensor.device.type`` builds a
    string)."""
    dtype = tensors[0].dtype
    if dtype not in _DTYPES:
        return None
    for t in tensors:
        if not t.is_cpu or t.dtype != dtype:
            return None
    return native.library()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """transformers' RMSNorm of ``x [rows, size]`` (fp32 statistics, rounded to the dtype,
    times the weight), or None."""
    module = _served(x, weight)
    if module is None or x.dim() != 2 or x.stride(-1) != 1:
        return None
    out: torch.Tensor = module.rms_norm(x, weight, eps)
    return out


def rope(
    heads: torch.Tensor, q_heads: int, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """RoPE (half-split, full rotary) of ``heads [T, Hq + Hk, D]`` with each token's table
    rows ``cos``/``sin [T, D]`` (signed sine, `rope.rope_tables`): contiguous ``q [T, Hq, D]``
    and ``k [T, Hk, D]``, computed in fp32 and rounded once; or None."""
    module = _served(heads, cos, sin)
    tokens, _, dim = heads.shape
    if module is None or cos.shape != (tokens, dim) or heads.stride()[1:] != (dim, 1):
        return None
    q, k = module.rope(heads, q_heads, cos.contiguous(), sin.contiguous())
    return q, k


def write_kv(
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
) -> bool:
    """``k``/``v [T, Hkv, D]`` into the caches' slots (< 0 skipped); False where the kernel
    does not serve (then nothing was written)."""
    module = _served(k_store, v_store, k, v)
    rows = (k, v)  # each token's heads contiguous, tokens strided (views of the qkv output)
    if (
        module is None
        or slots.dtype != torch.int64
        or not (k_store.is_contiguous() and v_store.is_contiguous())
        or any(t.dim() != 3 or t.stride(2) != 1 or t.stride(1) != t.shape[2] for t in rows)
    ):
        return False
    module.write_kv(k_store, v_store, k, v, slots)
    return True


def argmax(x: torch.Tensor) -> torch.Tensor | None:
    """``x.argmax(dim=-1)`` of ``x [rows, n]`` (first index of the largest, NaN largest), or None."""
    module = _served(x)
    if module is None or x.dim() != 2 or x.stride(-1) != 1:
        return None
    out: torch.Tensor = module.argmax(x)
    return out
