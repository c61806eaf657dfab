"""The Triton backend: ``kv_write``, split-K decode and paged prefill kernels.

Decode rows (sequences with one query) always go to the split-K decode kernel, so a
sequence's result does not depend on whether its step also carried prefills; the rows of
multi-query sequences (prefill chunks) go to the prefill kernel.
"""

from __future__ import annotations

import torch

from kvgate.engine.attention.kv_cache import KVCache
from kvgate.engine.attention.metadata import AttentionMetadata
from kvgate.engine.attention.triton.kv_write import kv_write
from kvgate.engine.attention.triton.paged_decode import paged_decode
from kvgate.engine.attention.triton.paged_prefill import paged_prefill


def write_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    kv_write(cache, k, v, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    cache: KVCache,
    md: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Same contract as ``torch_backend.paged_attention``."""
    if md.max_query_len == 1:
        return paged_decode(
            q, cache, md.seq_lens, md.block_tables, md.max_seq_len, scale,
            window=window, softcap=softcap,
        )  # fmt: skip
    out = torch.empty_like(q)
    paged_prefill(q, cache, md, scale, out, window=window, softcap=softcap)
    starts = md.query_start_loc
    decodes = ((starts[1:] - starts[:-1]) == 1).nonzero().squeeze(1)
    if decodes.numel() > 0:
        rows = starts.index_select(0, decodes).long()
        seq_lens = md.seq_lens.index_select(0, decodes)
        tables = md.block_tables.index_select(0, decodes)
        max_len = int(seq_lens.max())
        out[rows] = paged_decode(
            q[rows], cache, seq_lens, tables, max_len, scale, window=window, softcap=softcap
        )
    return out
