"""Cache storage: fp8 quantization, the scatter write, and sizing from a byte budget."""

import pytest
import torch

from kvgate.engine.attention import (
    allocate_kv_caches,
    kv_bytes_per_token,
    resolve_cache_dtype,
    write_kv,
)
from kvgate.engine.attention.kv_cache import FP8_DTYPE, FP8_MAX, dequantize_fp8, quantize_fp8


def test_fp8_round_trip_error_is_within_e4m3_precision() -> None:
    x = torch.randn(64, 4, 80) * torch.logspace(-3, 3, 64)[:, None, None]
    values, scale = quantize_fp8(x)
    assert values.dtype == FP8_DTYPE and scale.shape == (64, 4)
    # e4m3 keeps 3 mantissa bits: half an ulp is 1/16 relative, plus subnormals near zero.
    err = (dequantize_fp8(values, scale) - x).abs()
    assert bool((err <= x.abs() / 16 + scale[..., None] * 2**-9).all())


def test_fp8_zeros_and_huge_values_saturate_without_nan() -> None:
    x = torch.zeros(3, 2, 16)
    x[1] = 1e4
    x[2, :, ::2] = -1e4
    values, scale = quantize_fp8(x)
    back = dequantize_fp8(values, scale)
    assert not back.isnan().any()
    assert bool((back[0] == 0).all())
    torch.testing.assert_close(back[1:], x[1:])
    assert values.float().abs().max().item() == FP8_MAX


def test_write_kv_scatters_by_slot_and_skips_negative_slots() -> None:
    (cache,) = allocate_kv_caches(1, 4, 2, 4, 8, torch.float32, "cpu")
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv(cache, k, v, torch.tensor([5, -1, 14]))
    torch.testing.assert_close(cache.k[1, :, 1], k[0])
    torch.testing.assert_close(cache.v[3, :, 2], v[2])
    written = torch.zeros(4, 4, dtype=torch.bool)
    written[1, 1] = written[3, 2] = True
    assert bool((cache.k.permute(0, 2, 1, 3)[~written] == 0).all())


def test_write_kv_fp8_stores_quantized_values_and_scales() -> None:
    (cache,) = allocate_kv_caches(1, 3, 2, 4, 16, FP8_DTYPE, "cpu")
    k, v = torch.randn(2, 2, 16, dtype=torch.bfloat16), torch.randn(2, 2, 16, dtype=torch.bfloat16)
    write_kv(cache, k, v, torch.tensor([4, 11]))
    for store, scales, new in ((cache.k, cache.k_scale, k), (cache.v, cache.v_scale, v)):
        values, scale = quantize_fp8(new)
        assert torch.equal(store[[1, 2], :, [0, 3]].view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(scales[[1, 2], :, [0, 3]], scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8_DTYPE])
def test_bytes_per_token_matches_allocated_storage(dtype: torch.dtype) -> None:
    layers, blocks, heads, block_size, dim = 3, 5, 2, 16, 64
    caches = allocate_kv_caches(layers, blocks, heads, block_size, dim, dtype, "cpu")
    tensors = [t for c in caches for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None]
    total = sum(t.numel() * t.element_size() for t in tensors)
    assert total == blocks * block_size * kv_bytes_per_token(layers, heads, dim, dtype)


def test_fp8_nearly_doubles_capacity_at_head_dim_64() -> None:
    bf16 = kv_bytes_per_token(8, 4, 64, torch.bfloat16)
    fp8 = kv_bytes_per_token(8, 4, 64, FP8_DTYPE)
    # 128 B of bf16 per head vector vs 64 B of fp8 + a 4 B scale: 128 / 68 = 1.88x.
    assert bf16 / fp8 == pytest.approx(128 / 68)


def test_resolve_cache_dtype() -> None:
    assert resolve_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert resolve_cache_dtype("fp8", torch.bfloat16) == FP8_DTYPE
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_cache_dtype("int4", torch.bfloat16)
