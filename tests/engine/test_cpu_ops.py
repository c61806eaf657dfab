"""kvgate.engine.cpu_ops against the plain torch formulas they replace (and None where they do not
serve)."""

from __future__ import annotations

import pytest
import torch

import kvgate.engine.cpu_ops as cpu_ops
import kvgate.engine.native as native
from kvgate.engine.attention.kv_cache import KVCache
from kvgate.engine.attention.torch_backend import write_kv

pytestmark = pytest.mark.skipif(native.library() is None, reason="no native library")
DTYPES = [torch.bfloat16, torch.float32]


def _one_ulp(dtype: torch.dtype) -> float:
    return 2.0**-7 if dtype == torch.bfloat16 else 2.0**-22


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 8, 100])
@pytest.mark.parametrize("size", [96, 100])  # whole vectors; a scalar tail too
def test_rms_norm_is_transformers_formula(dtype: torch.dtype, rows: int, size: int) -> None:
    torch.manual_seed(rows)
    wide = torch.randn(rows, 2 * size, dtype=dtype) * 3
    x = wide[:, :size]  # strided rows
    weight = torch.randn(size, dtype=dtype)
    xf = x.float()
    want = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-6)).to(dtype) * weight
    got = cpu_ops.rms_norm(x, weight, 1e-6)
    assert got is not None and got.dtype == dtype and got.is_contiguous()
    # fp32 statistics summed in another order: at most one rounding step apart, rarely.
    torch.testing.assert_close(got, want, rtol=_one_ulp(dtype), atol=1e-6)
    if dtype == torch.bfloat16:  # the fp32 scale's last bits rarely change a bf16 rounding
        assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rounds_the_fp32_rotation_once(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    tokens, q_heads, k_heads, dim = 5, 4, 2, 64
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * dim, dtype=dtype)
    heads = qkv[:, : (q_heads + k_heads) * dim].view(tokens, q_heads + k_heads, dim)
    angles = torch.rand(tokens, dim // 2) * 20
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)
    out = cpu_ops.rope(heads, q_heads, cos, sin)
    assert out is not None
    q, k = out
    assert q.shape == (tokens, q_heads, dim) and k.shape == (tokens, k_heads, dim)
    assert q.is_contiguous() and k.is_contiguous()
    half = dim // 2
    swapped = torch.cat((heads[..., half:], heads[..., :half]), -1).float()
    want = (heads.float() * cos[:, None].float() + swapped * sin[:, None].float()).to(dtype)
    torch.testing.assert_close(torch.cat((q, k), 1), want, rtol=_one_ulp(dtype), atol=1e-6)


def test_rope_declines_partial_rotary_and_other_dtypes() -> None:
    heads = torch.randn(3, 6, 64)
    table = torch.randn(3, 32)
    assert cpu_ops.rope(heads, 4, table, table) is None  # rotary dim < head dim
    half = heads.half()
    assert cpu_ops.rope(half, 4, torch.randn(3, 64).half(), torch.randn(3, 64).half()) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_matches_the_torch_scatter(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    blocks, kv_heads, block_size, dim, tokens = 6, 2, 4, 32, 7

    def cache() -> KVCache:
        shape = (blocks, kv_heads, block_size, dim)
        return KVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))

    rows = torch.randn(tokens, 3 * kv_heads * dim, dtype=dtype)
    k = rows[:, : kv_heads * dim].view(tokens, kv_heads, dim)  # token-strided views
    v = rows[:, kv_heads * dim : 2 * kv_heads * dim].view(tokens, kv_heads, dim)
    slots = torch.tensor([0, 5, -1, 13, 23, -1, 9])
    native, reference = cache(), cache()
    assert cpu_ops.write_kv(native.k, native.v, k, v, slots)
    valid = slots >= 0
    s = slots[valid]
    reference.k[s // block_size, :, s % block_size] = k[valid]
    reference.v[s // block_size, :, s % block_size] = v[valid]
    assert torch.equal(native.k, reference.k) and torch.equal(native.v, reference.v)
    again = cache()
    write_kv(again, k, v, slots)  # the backend's entry point takes the native path
    assert torch.equal(again.k, reference.k)


def test_write_kv_declines_a_dtype_mismatch() -> None:
    store = torch.zeros(2, 1, 4, 8, dtype=torch.bfloat16)
    rows = torch.randn(1, 1, 8)
    assert not cpu_ops.write_kv(store, store.clone(), rows, rows, torch.tensor([0]))
    assert not store.any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_is_torchs(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    x = torch.randn(6, 1000).to(dtype)
    x[1, 10] = x[1, 500] = 100.0  # a tie: the first index
    x[2, 7] = float("nan")  # NaN is the largest
    x[3] = float("-inf")
    x[4, 3] = float("inf")
    got = cpu_ops.argmax(x)
    assert got is not None and torch.equal(got, x.argmax(dim=-1))
