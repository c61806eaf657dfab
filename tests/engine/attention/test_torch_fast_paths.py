"""The CPU reference's fast path (a power-of-two scale folded into the queries, bf16 scores fed
to a softmax that accumulates in fp32) gives the same bits as scaling fp32 scores."""

from __future__ import annotations

import pytest
import torch

from kvgate.engine.attention import (
    AttentionMetadata,
    allocate_kv_caches,
    paged_attention,
    torch_backend,
    write_kv,
)


def _slow_scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    assert softcap is None
    return torch.matmul(q, k.transpose(-1, -2)).float().mul_(scale)


@pytest.mark.parametrize("query_len", [1, 40])
def test_power_of_two_scale_path_is_bit_identical(
    query_len: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, seq_len, block = 4, 2, 64, 70, 16
    cache = allocate_kv_caches(1, 8, kv_heads, block, dim, torch.bfloat16, "cpu")[0]
    table = list(range(1, 6))
    full = AttentionMetadata.from_lists([seq_len], [seq_len], [table], block)
    k, v = (torch.randn(seq_len, kv_heads, dim, generator=gen).bfloat16() for _ in range(2))
    write_kv(cache, k, v, full.slot_mapping)
    q = torch.randn(query_len, heads, dim, generator=gen).bfloat16()

    def attend() -> torch.Tensor:
        md = AttentionMetadata.from_lists([seq_len], [query_len], [table], block)
        return paged_attention(q, cache, md, dim**-0.5)

    fast = attend()
    monkeypatch.setattr(torch_backend, "_scores", _slow_scores)
    assert torch.equal(fast, attend())
