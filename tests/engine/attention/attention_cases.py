"""Random paged-attention cases and a dense oracle, shared by the reference and kernel tests.

Cases live on ``KVGATE_TEST_DEVICE`` (default ``cpu``): ``benchmarks/gpu_kernels.py`` sets it
to ``cuda`` to run the same kernel tests natively on a GPU. The oracle always runs on the CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kvgate.engine.attention import AttentionMetadata, KVCache, allocate_kv_caches, write_kv
from kvgate.engine.attention.kv_cache import dequantize_fp8, quantize_fp8

DEVICE = torch.device(os.environ.get("KVGATE_TEST_DEVICE", "cpu"))


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, Hq, D]
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D], fp32, as written
    values: list[torch.Tensor]
    cache: KVCache
    md: AttentionMetadata
    query_lens: list[int]
    scale: float

    def stored(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence i's K/V as the cache holds them (dequantized for fp8), fp32."""
        if not self.cache.is_fp8:
            return (
                self.keys[i].to(self.cache.k.dtype).float(),
                self.values[i].to(self.cache.v.dtype).float(),
            )
        return tuple(dequantize_fp8(*quantize_fp8(x)) for x in (self.keys[i], self.values[i]))


def make_case(
    seq_lens: list[int],
    query_lens: list[int],
    num_heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 32,
    block_size: int = 16,
    cache_dtype: torch.dtype = torch.float32,
    q_dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedCase:
    """Sequences in shuffled, non-contiguous blocks; unused slots hold large garbage."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = 1 + sum(per_seq) + 3
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    for n in per_seq:
        tables.append(ids[:n])
        ids = ids[n:]
    (cache,) = allocate_kv_caches(
        1, num_blocks, kv_heads, block_size, head_dim, cache_dtype, DEVICE
    )
    garbage = 300 * torch.randn(cache.k.shape, generator=gen)
    cache.k.copy_(garbage.clamp(-448, 448).to(DEVICE))
    cache.v.copy_(garbage.flip(0).clamp(-448, 448).to(DEVICE))
    keys = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in seq_lens]
    values = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in seq_lens]
    full = AttentionMetadata.from_lists(seq_lens, seq_lens, tables, block_size, DEVICE)
    write_kv(cache, torch.cat(keys).to(DEVICE), torch.cat(values).to(DEVICE), full.slot_mapping)
    md = AttentionMetadata.from_lists(seq_lens, query_lens, tables, block_size, DEVICE)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(DEVICE, q_dtype)
    return PagedCase(q, keys, values, cache, md, query_lens, head_dim**-0.5)


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
    window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Plain causal attention in fp64: ``q [n_q, Hq, D]`` are the last positions of ``k [L, Hkv, D]``;
    a query at position p sees keys j with p - window < j <= p; scores soft-capped as Gemma 2."""
    n_q, num_heads, _ = q.shape
    seq_len, kv_heads, _ = k.shape
    group = num_heads // kv_heads
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(seq_len - n_q, seq_len)[:, None]
    keys = torch.arange(seq_len)[None, :]
    hidden = keys > pos
    if window is not None:
        hidden |= keys <= pos - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def expected_output(
    case: PagedCase, dequantized: bool = True, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Dense attention per sequence over the stored (or the original fp32) K/V."""
    outs, start = [], 0
    for i, n_q in enumerate(case.query_lens):
        k, v = case.stored(i) if dequantized else (case.keys[i], case.values[i])
        q = case.q[start : start + n_q].float().cpu()
        outs.append(dense_attention(q, k, v, case.scale, window, softcap))
        start += n_q
    return torch.cat(outs).to(case.q.device)
