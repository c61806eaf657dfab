"""The Triton backend: Triton ``kv_write`` and decode kernels, prefill rows via the reference.

Decode rows of a step (one query per sequence) go to the flash-decoding kernel in one launch;
sequences with several queries (prefill chunks) still use the PyTorch reference for now.
"""

from __future__ import annotations

import torch

from engine.attention import torch_backend
from engine.attention.kv_cache import KVCache
from engine.attention.metadata import AttentionMetadata
from engine.kernels.kv_write import kv_write
from engine.kernels.paged_decode import paged_decode


def write_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    kv_write(cache, k, v, slot_mapping)


def paged_attention(
    q: torch.Tensor, cache: KVCache, md: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Same contract as ``torch_backend.paged_attention``."""
    if md.max_query_len == 1:
        return paged_decode(q, cache, md.seq_lens, md.block_tables, md.max_seq_len, scale)
    plan = torch_backend.step_plan(md, cache.block_size, cache.k.shape[1])
    out = torch.empty_like(q)
    if plan.num_decodes > 0:
        seq_lens = md.seq_lens.index_select(0, plan.decode_seqs)
        tables = md.block_tables.index_select(0, plan.decode_seqs)
        max_len = int(seq_lens.max())
        out[plan.decode_query_rows] = paged_decode(
            q[plan.decode_query_rows], cache, seq_lens, tables, max_len, scale
        )
    torch_backend.attend_prefills(q, cache, plan, scale, out)
    return out
