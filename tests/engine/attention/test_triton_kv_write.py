"""The Triton ``kv_write`` kernel against the PyTorch reference ``write_kv``."""

import pytest
import torch
from attention_cases import DEVICE

from kvgate.engine.attention import KVCache, allocate_kv_caches, write_kv
from kvgate.engine.attention.kv_cache import FP8_DTYPE
from kvgate.engine.attention.triton.kv_write import kv_write

pytestmark = pytest.mark.triton


def _both(dtype: torch.dtype, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor):
    """Write the same K/V with the kernel and the reference into identical fresh caches
    (6 blocks of 4 slots); both come back on the CPU."""
    k, v, slots = k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE)
    written = []
    for write in (kv_write, write_kv):
        (cache,) = allocate_kv_caches(1, 6, k.shape[1], 4, k.shape[2], dtype, DEVICE)
        write(cache, k, v, slots)
        tensors = (cache.k, cache.v, cache.k_scale, cache.v_scale)
        written.append(KVCache(*(t if t is None else t.cpu() for t in tensors)))
    return written


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_bytes_and_scales_match_the_reference(src_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    k = (torch.randn(9, 2, 80, generator=gen) * torch.logspace(-4, 2, 9)[:, None, None]).to(
        src_dtype
    )
    v = torch.randn(9, 2, 80, generator=gen).to(src_dtype)
    slots = torch.randperm(20, generator=gen)[:9] + 4
    kernel, reference = _both(FP8_DTYPE, k, v, slots)
    for got, want in ((kernel.k, reference.k), (kernel.v, reference.v)):
        ulps = (got.view(torch.uint8).int() - want.view(torch.uint8).int()).abs()
        assert ulps.max().item() <= 1  # the kernel rounds exactly; ±1 ulp allows GPU division
    torch.testing.assert_close(kernel.k_scale, reference.k_scale, rtol=1e-6, atol=0)
    torch.testing.assert_close(kernel.v_scale, reference.v_scale, rtol=1e-6, atol=0)


def test_negative_slots_leave_the_cache_untouched() -> None:
    k = torch.randn(4, 2, 16)
    slots = torch.tensor([-1, 5, -1, 9])
    kernel, reference = _both(FP8_DTYPE, k, k.flip(0), slots)
    assert torch.equal(kernel.k.view(torch.uint8), reference.k.view(torch.uint8))
    assert torch.equal(kernel.v_scale, reference.v_scale)
    written = torch.zeros(6, 4, dtype=torch.bool)
    written[1, 1] = written[2, 1] = True
    untouched = kernel.k.permute(0, 2, 1, 3)[~written]
    assert bool((untouched.float() == 0).all())
    assert bool((kernel.k_scale.permute(0, 2, 1)[~written] == 1).all())


def test_zeros_and_huge_values_saturate_without_nan() -> None:
    k = torch.zeros(3, 1, 32)
    k[1] = 1e4
    k[2, :, 1::2] = -1e4
    kernel, reference = _both(FP8_DTYPE, k, -k, torch.tensor([1, 2, 3]))
    values = kernel.k.float() * kernel.k_scale[..., None]
    assert not values.isnan().any() and not kernel.v.float().isnan().any()
    assert torch.equal(kernel.k.view(torch.uint8), reference.k.view(torch.uint8))
    torch.testing.assert_close(values[0, 0, 1:4], k[:, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unquantized_caches_store_exact_copies(dtype: torch.dtype) -> None:
    # K/V arrive in the model dtype, which is the cache dtype when the cache is not fp8.
    k, v = torch.randn(5, 3, 24, dtype=dtype), torch.randn(5, 3, 24, dtype=dtype)
    slots = torch.tensor([7, 0, 22, -1, 13])
    kernel, reference = _both(dtype, k, v, slots)
    assert torch.equal(kernel.k, reference.k) and torch.equal(kernel.v, reference.v)
    assert kernel.k_scale is None
