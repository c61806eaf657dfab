"""The Triton paged prefill kernel against dense attention, on mixed steps."""

import pytest
import torch
from attention_cases import expected_output, make_case

from kvgate.engine.attention.kv_cache import FP8_DTYPE
from kvgate.engine.attention.triton.paged_prefill import paged_prefill

pytestmark = pytest.mark.triton


def _prefill_rows(case) -> tuple[torch.Tensor, torch.Tensor]:
    """(kernel output, dense output) on the rows of multi-query sequences; asserts that the
    decode rows were left alone."""
    out = torch.full_like(case.q, 7.0)
    paged_prefill(case.q, case.cache, case.md, case.scale, out)
    multi = torch.tensor([n for n in case.query_lens for _ in range(n)], device=out.device) > 1
    assert bool((out[~multi] == 7.0).all())
    return out[multi], expected_output(case)[multi]


@pytest.mark.parametrize("num_heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_gqa_ratios_on_a_mixed_step(num_heads: int, kv_heads: int) -> None:
    # A fresh prompt, a decode, a chunk continuing a cached prefix (ending mid-block).
    case = make_case([20, 33, 45], [20, 1, 13], num_heads, kv_heads, head_dim=32,
                     cache_dtype=FP8_DTYPE)  # fmt: skip
    got, want = _prefill_rows(case)
    torch.testing.assert_close(got.double(), want, atol=1e-3, rtol=0)


@pytest.mark.parametrize("head_dim", [64, 80])
def test_queries_spanning_several_tiles(head_dim: int) -> None:
    case = make_case([90, 17], [75, 16], 4, 2, head_dim=head_dim, cache_dtype=FP8_DTYPE)
    got, want = _prefill_rows(case)
    torch.testing.assert_close(got.double(), want, atol=1e-3, rtol=0)
    exact = expected_output(case, dequantized=False)[: 75 + 16]
    assert ((got.double() - exact).norm() / exact.norm()).item() < 0.05


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_unquantized_caches(cache_dtype: torch.dtype) -> None:
    case = make_case([16, 40], [16, 24], 4, 2, head_dim=32, cache_dtype=cache_dtype)
    got, want = _prefill_rows(case)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=0)


def test_bf16_queries_on_fp8_cache() -> None:
    case = make_case([40, 9], [24, 9], 8, 2, head_dim=64, cache_dtype=FP8_DTYPE,
                     q_dtype=torch.bfloat16)  # fmt: skip
    got, want = _prefill_rows(case)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=0)
