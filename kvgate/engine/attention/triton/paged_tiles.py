"""The inner step both paged attention kernels share: one tile of ``BLOCK_N`` keys.

A kernel walks its visible keys tile by tile; for each it calls ``paged_key_scores`` (look
the keys up through the block table, ``q @ K^T``, times the fp8 K scale), applies its own
mask and softmax scale, then ``online_softmax_step`` folds the tile's values into the fp32
running max / sum / accumulator. Keeping the step in one place keeps decode and prefill
numerically identical: the same loads, the same dot dtypes, the same order of operations.

    keys:  tok = n0 .. n0+BLOCK_N  --block table-->  (block, offset)  -->  K, V rows
    scale: s = scores * scale (optionally soft-capped: cap * tanh(s / cap)), in base 2
    step:  m' = max(m, rowmax(s));  l' = l * 2^(m-m') + sum 2^(s-m');  acc' = acc * 2^(m-m') + P V
"""

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # kernels work in base 2: exp(x) = exp2(x * LOG2E)
LOG2E_CONST: tl.constexpr = tl.constexpr(LOG2E)


def dot_dtype(q: torch.Tensor, cache_dtype: torch.dtype) -> tuple[tl.dtype, str]:
    """Tensor-core inputs on a GPU when they lose nothing (fp8 or same-dtype cache), else
    exact fp32 (also under the CPU interpreter, whose bf16 dot is unreliable)."""
    half = q.dtype in (torch.bfloat16, torch.float16)
    if q.is_cuda and half and cache_dtype in (q.dtype, torch.float8_e4m3fn):
        return (tl.bfloat16 if q.dtype == torch.bfloat16 else tl.float16), "tf32"
    return tl.float32, "ieee"


@triton.jit
def paged_key_scores(
    q, k_cache_ptr, k_scale_ptr, table_ptr, tok, valid, d, kv_head, head_dim, block_size,
    stride_cb, stride_ch, stride_cs, stride_sb, stride_sh,
    FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Unscaled, unmasked scores ``q @ K^T`` of keys ``tok`` (``valid`` ones are read) of one
    KV head; ``table_ptr`` is the sequence's block-table row. Also returns the keys' cache
    and scale offsets, which the V side reads with."""
    block = tl.load(table_ptr + tok // block_size, mask=valid, other=0).to(tl.int64)
    offset = tok % block_size
    kv_off = block * stride_cb + kv_head * stride_ch + offset * stride_cs
    scale_off = block * stride_sb + kv_head * stride_sh + offset  # used only when FP8
    kv_mask = valid[:, None] & (d < head_dim)[None, :]
    k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION)
    if FP8:
        scores = scores * tl.load(k_scale_ptr + scale_off, mask=valid, other=0.0)[None, :]
    return scores, kv_off, scale_off


@triton.jit
def scale_scores(scores, sm_scale_log2, softcap, SOFTCAP: tl.constexpr):
    """Raw ``q @ K^T`` -> base-2 logits: times the softmax scale, soft-capped to
    ``softcap * tanh(s / softcap)`` first when ``SOFTCAP`` (Gemma 2). tanh is written with
    exp (``1 - 2 / (e^2x + 1)``, exact at both saturations), which every backend has."""
    if SOFTCAP:
        x = scores * (sm_scale_log2 / LOG2E_CONST) / softcap
        capped = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
        return capped * (softcap * LOG2E_CONST)
    return scores * sm_scale_log2


@triton.jit
def online_softmax_step(
    scores, m_i, l_i, acc, v_cache_ptr, v_scale_ptr, kv_off, scale_off, valid, d, head_dim,
    FP8: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Fold a tile of masked base-2 ``scores`` and its V rows into ``(m_i, l_i, acc)``.
    A row that has seen no visible key yet keeps ``m = -inf`` and ``l = 0`` instead of NaN."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if FP8:
        p = p * tl.load(v_scale_ptr + scale_off, mask=valid, other=0.0)[None, :]
    kv_mask = valid[:, None] & (d < head_dim)[None, :]
    v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
    pv = tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=PRECISION)
    return m_new, l_i, acc * alpha[:, None] + pv
