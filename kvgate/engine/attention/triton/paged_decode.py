"""Paged decode attention, flash-decoding style: one query per sequence, GQA, fp8 or bf16 cache.

Stage 1 splits each sequence's context into chunks; one program handles (sequence, KV head,
split) and all ``G = Hq / Hkv`` query heads that share that KV head, so each K/V byte is read
once. It runs an fp32 online softmax (the fp8 K scale multiplies the scores, the V scale the
probabilities) and writes a partial output with its log-sum-exp. Stage 2 merges the splits.

    context:  |---- split 0 ----|---- split 1 ----|-- split 2 --|
    stage 1:    o0, lse0           o1, lse1          o2, lse2
    stage 2:  out = sum_s exp(lse_s - max) * o_s / sum_s exp(lse_s - max)

The number of splits depends only on the sequence's length, never on the batch, and the merge
always reduces over the same padded width, so a sequence gets bit-identical results whatever
it is batched with. Rows with no visible key
(empty splits) are guarded instead of producing NaN. Head sizes are padded to a power of two.
Reference: ``kvgate.engine.attention.torch_backend.paged_attention``.
"""

import math

import torch
import triton
import triton.language as tl

from kvgate.engine.attention.kv_cache import KVCache
from kvgate.engine.attention.triton.paged_tiles import (
    LOG2E,
    dot_dtype,
    online_softmax_step,
    paged_key_scores,
    scale_scores,
)

SPLIT_TOKENS = 256  # a split covers at least this many tokens...
MAX_SPLITS = 64  # ...and a sequence has at most this many splits
BLOCK_N = 64  # keys per inner iteration


def num_splits(seq_len: int, split_tokens: int = SPLIT_TOKENS, max_splits: int = MAX_SPLITS) -> int:
    """How many splits a sequence of ``seq_len`` gets (mirrors the kernels' formula)."""
    return max(1, min(math.ceil(seq_len / split_tokens), max_splits))


@triton.jit
def _split_bounds(seq_len, split, split_tokens, max_splits, BLOCK_N: tl.constexpr):
    n_splits = tl.maximum(tl.minimum(tl.cdiv(seq_len, split_tokens), max_splits), 1)
    split_len = tl.cdiv(tl.cdiv(seq_len, n_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    return n_splits, start, tl.minimum(start + split_len, seq_len)


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, seq_lens_ptr, block_tables_ptr,
    o_part_ptr, lse_ptr,
    stride_qt, stride_qh, stride_cb, stride_ch, stride_cs, stride_sb, stride_sh, stride_bt,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    sm_scale_log2, softcap, window, group, head_dim, block_size, split_tokens, max_splits,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr,
    SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    _, start, end = _split_bounds(seq_len, split, split_tokens, max_splits, BLOCK_N)
    # A sliding window (window > 0) hides keys before seq_len - window: skip their tiles.
    lo = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    first = tl.maximum(start, (lo // BLOCK_N) * BLOCK_N)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    heads = kv_head * group + g
    row_mask = (g < group)[:, None] & (d < head_dim)[None, :]
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=row_mask,
                other=0.0).to(DOT_DTYPE)  # fmt: skip

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for n0 in range(first, end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        valid = (tok < end) & (tok >= lo)
        scores, kv_off, scale_off = paged_key_scores(
            q, k_cache_ptr, k_scale_ptr, block_tables_ptr + seq * stride_bt, tok, valid, d,
            kv_head, head_dim, block_size, stride_cb, stride_ch, stride_cs, stride_sb, stride_sh,
            FP8, DOT_DTYPE, PRECISION,
        )  # fmt: skip
        scores = scale_scores(scores, sm_scale_log2, softcap, SOFTCAP)
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_i, l_i, acc = online_softmax_step(
            scores, m_i, l_i, acc, v_cache_ptr, v_scale_ptr, kv_off, scale_off, valid, d,
            head_dim, FP8, DOT_DTYPE, PRECISION,
        )  # fmt: skip

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    o_off = seq * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
    tl.store(o_part_ptr + o_off, out, mask=row_mask)
    tl.store(lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=g < group)


@triton.jit
def _merge_splits_kernel(
    o_part_ptr, lse_ptr, seq_lens_ptr, out_ptr,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh, stride_outt, stride_outh,
    head_dim, split_tokens, max_splits,
    S_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    n_splits, _, _ = _split_bounds(seq_len, 0, split_tokens, max_splits, BLOCK_N)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < n_splits
    lse = tl.load(lse_ptr + seq * stride_lb + head * stride_lh + s, mask=s_mask,
                  other=float("-inf"))  # fmt: skip
    m = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))
    o_off = seq * stride_ob + head * stride_oh + s[:, None] * stride_os + d[None, :]
    o = tl.load(o_part_ptr + o_off, mask=s_mask[:, None] & (d < head_dim)[None, :], other=0.0)
    total = tl.sum(weight, axis=0)
    out = tl.sum(weight[:, None] * o, axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + seq * stride_outt + head * stride_outh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < head_dim)  # fmt: skip


def paged_decode(
    q: torch.Tensor,
    cache: KVCache,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_seq_len: int,
    scale: float,
    split_tokens: int = SPLIT_TOKENS,
    max_splits: int = MAX_SPLITS,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one query per sequence, ``q [B, Hq, D]``, over its whole context (its
    last ``window`` keys with a sliding window), scores soft-capped when ``softcap``."""
    batch, num_heads, head_dim = q.shape
    kv_heads = cache.k.shape[1]
    group = num_heads // kv_heads
    grid_splits = num_splits(max_seq_len, split_tokens, max_splits)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    o_part = torch.empty(batch, num_heads, grid_splits, d_pad, dtype=torch.float32, device=q.device)
    lse = torch.empty(batch, num_heads, grid_splits, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    if batch == 0:
        return out
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    assert cache.k.stride() == cache.v.stride() and cache.k.stride(-1) == 1
    fp8 = cache.k_scale is not None
    scales = cache.kernel_scales()
    dot, precision = dot_dtype(q, cache.k.dtype)
    _decode_split_kernel[(batch, kv_heads, grid_splits)](
        q, cache.k, cache.v, *scales, seq_lens, block_tables, o_part, lse,
        q.stride(0), q.stride(1), cache.k.stride(0), cache.k.stride(1), cache.k.stride(2),
        scales[0].stride(0), scales[0].stride(1), block_tables.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        scale * LOG2E, softcap or 0.0, window or 0, group, head_dim, cache.block_size,
        split_tokens, max_splits,
        G_PAD=max(16, triton.next_power_of_2(group)), D_PAD=d_pad, BLOCK_N=BLOCK_N, FP8=fp8,
        SOFTCAP=softcap is not None, DOT_DTYPE=dot, PRECISION=precision,
    )  # fmt: skip
    _merge_splits_kernel[(batch, num_heads)](
        o_part, lse, seq_lens, out,
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1), head_dim, split_tokens, max_splits,
        S_PAD=triton.next_power_of_2(max_splits), D_PAD=d_pad, BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return out
