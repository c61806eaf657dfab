"""Paged prefill attention: the rows of the sequences that compute several queries in a step.

A program takes a tile of ``BLOCK_Q`` consecutive queries of one sequence and one KV head,
with the ``G`` query heads of that KV head stacked as rows (``BLOCK_Q * G_PAD`` rows), and
runs an fp32 online softmax over the keys the tile can see. Query ``t`` of a sequence with
``n_q`` queries and ``seq_len`` keys sits at position ``seq_len - n_q + t`` and sees keys
``0 ..= position``, so a chunked prefill never reads slots past its chunk's end.

    sequence i:  |------- cached prefix -------|== n_q new queries ==|
    tile k:                                     [t0 ...... t0+BLOCK_Q)
    keys read:   0 ........................................ t0+BLOCK_Q-1 (causal mask inside)

Sequences with a single query (decodes) are skipped: they belong to the split-K decode
kernel, whose results do not depend on what else is in the batch.
"""

import torch
import triton
import triton.language as tl

from kvgate.engine.attention.kv_cache import KVCache
from kvgate.engine.attention.metadata import AttentionMetadata
from kvgate.engine.attention.triton.paged_tiles import (
    LOG2E,
    dot_dtype,
    online_softmax_step,
    paged_key_scores,
    scale_scores,
)

BLOCK_ROWS = 64  # query rows (queries x padded heads) per program
BLOCK_N = 64  # keys per inner iteration


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr,
    tile_seq_ptr, tile_first_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ch, stride_cs,
    stride_sb, stride_sh, stride_bt,
    sm_scale_log2, softcap, window, num_seqs, group, head_dim, block_size,
    BLOCK_Q: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr, SOFTCAP: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + tile)
    present = seq < num_seqs  # the tile map is padded to an upper bound
    seq = tl.where(present, seq, 0).to(tl.int64)
    first = tl.load(tile_first_ptr + tile)
    q_start = tl.load(query_start_ptr + seq)
    n_q = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    count = tl.where(present & (n_q > 1), tl.minimum(n_q - first, BLOCK_Q), 0)

    r = tl.arange(0, BLOCK_Q * G_PAD)
    t = r // G_PAD  # query within the tile
    g = r % G_PAD  # query head within the group
    d = tl.arange(0, D_PAD)
    row_ok = (t < count) & (g < group)
    pos = seq_len - n_q + first + t  # the query's position = the last key it may see
    q_rows = (q_start + first + t).to(tl.int64) * stride_qt + (kv_head * group + g) * stride_qh
    io_mask = row_ok[:, None] & (d < head_dim)[None, :]
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=io_mask, other=0.0).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)
    kv_end = tl.where(count > 0, seq_len - n_q + first + count, 0)
    # With a sliding window (window > 0) the tile's first query sees nothing before
    # its position - window + 1: start at that key's tile.
    kv_start = tl.where(window > 0, tl.maximum(seq_len - n_q + first - window + 1, 0), 0)
    for n0 in range((kv_start // BLOCK_N) * BLOCK_N, kv_end, BLOCK_N):
        tok = n0 + tl.arange(0, BLOCK_N)
        valid = tok < kv_end
        scores, kv_off, scale_off = paged_key_scores(
            q, k_cache_ptr, k_scale_ptr, block_tables_ptr + seq * stride_bt, tok, valid, d,
            kv_head, head_dim, block_size, stride_cb, stride_ch, stride_cs, stride_sb, stride_sh,
            FP8, DOT_DTYPE, PRECISION,
        )  # fmt: skip
        visible = valid[None, :] & (tok[None, :] <= pos[:, None]) & row_ok[:, None]
        visible = visible & ((window <= 0) | (tok[None, :] > pos[:, None] - window))
        scores = scale_scores(scores, sm_scale_log2, softcap, SOFTCAP)
        scores = tl.where(visible, scores, float("-inf"))
        m_i, l_i, acc = online_softmax_step(
            scores, m_i, l_i, acc, v_cache_ptr, v_scale_ptr, kv_off, scale_off, valid, d,
            head_dim, FP8, DOT_DTYPE, PRECISION,
        )  # fmt: skip

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_rows = (q_start + first + t).to(tl.int64) * stride_ot + (kv_head * group + g) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _tile_map(md: AttentionMetadata, block_q: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, first query) of every tile, on the device and without a host sync: the
    map is padded to an upper bound on the tile count, padding tiles name sequence ``B``."""
    num_tokens, num_seqs = md.positions.shape[0], md.seq_lens.shape[0]
    q_lens = md.query_start_loc[1:] - md.query_start_loc[:-1]
    tiles = torch.where(q_lens > 1, (q_lens + block_q - 1) // block_q, 0)
    ends = torch.cumsum(tiles, 0)
    ids = torch.arange(triton.cdiv(num_tokens, block_q) + num_seqs, device=q_lens.device)
    seq = torch.searchsorted(ends, ids, right=True)
    first_tile = (ends - tiles).index_select(0, seq.clamp(max=num_seqs - 1))
    return seq.to(torch.int32), ((ids - first_tile) * block_q).to(torch.int32)


def paged_prefill(
    q: torch.Tensor,
    cache: KVCache,
    md: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Write into ``out [T, Hq, D]`` the attention of every row of a multi-query sequence
    (each query sees its last ``window`` keys with a sliding window; soft-capped scores
    when ``softcap``)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = cache.k.shape[1]
    group = num_heads // kv_heads
    g_pad = triton.next_power_of_2(group)
    block_q = max(1, BLOCK_ROWS // g_pad)
    tile_seq, tile_first = _tile_map(md, block_q)
    q = q if q.stride(-1) == 1 else q.contiguous()
    assert out.stride(-1) == 1 and cache.k.stride() == cache.v.stride()
    tables = md.block_tables if md.block_tables.stride(-1) == 1 else md.block_tables.contiguous()
    fp8 = cache.k_scale is not None
    scales = cache.kernel_scales()
    dot, precision = dot_dtype(q, cache.k.dtype)
    _prefill_kernel[(tile_seq.shape[0], kv_heads)](
        q, cache.k, cache.v, *scales, out, tile_seq, tile_first, md.query_start_loc,
        md.seq_lens, tables,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.k.stride(0), cache.k.stride(1), cache.k.stride(2),
        scales[0].stride(0), scales[0].stride(1), tables.stride(0),
        scale * LOG2E, softcap or 0.0, window or 0, md.seq_lens.shape[0], group, head_dim,
        cache.block_size,
        BLOCK_Q=block_q, G_PAD=g_pad, D_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=BLOCK_N, FP8=fp8, SOFTCAP=softcap is not None, DOT_DTYPE=dot,
        PRECISION=precision,
    )  # fmt: skip
