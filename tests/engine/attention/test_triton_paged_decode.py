"""The Triton flash-decoding kernel against the reference and against unquantized attention."""

import pytest
import torch
from attention_cases import DEVICE, expected_output, make_case

from kvgate.engine.attention import AttentionMetadata
from kvgate.engine.attention.kv_cache import FP8_DTYPE
from kvgate.engine.attention.triton.paged_decode import paged_decode

pytestmark = pytest.mark.triton


def _decode(case, **kwargs) -> torch.Tensor:
    md = case.md
    return paged_decode(case.q, case.cache, md.seq_lens, md.block_tables, md.max_seq_len,
                        case.scale, **kwargs)  # fmt: skip


def _check_fp8(case, out: torch.Tensor) -> None:
    torch.testing.assert_close(out.double(), expected_output(case), atol=1e-3, rtol=0)
    exact = expected_output(case, dequantized=False)
    assert ((out.double() - exact).norm() / exact.norm()).item() < 0.05


@pytest.mark.parametrize("num_heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_gqa_ratios(num_heads: int, kv_heads: int) -> None:
    case = make_case([33, 5], [1, 1], num_heads, kv_heads, head_dim=64, cache_dtype=FP8_DTYPE)
    _check_fp8(case, _decode(case))


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_head_sizes_including_non_powers_of_two(head_dim: int) -> None:
    case = make_case([20], [1], 2, 1, head_dim=head_dim, cache_dtype=FP8_DTYPE)
    _check_fp8(case, _decode(case))


def test_block_boundary_lengths_in_shuffled_blocks() -> None:
    lengths = [1, 15, 16, 17]
    case = make_case(lengths, [1] * 4, 4, 2, head_dim=32, cache_dtype=FP8_DTYPE)
    _check_fp8(case, _decode(case))


def test_many_blocks_over_several_splits() -> None:
    case = make_case([300, 70], [1, 1], 4, 2, head_dim=32, cache_dtype=FP8_DTYPE)
    _check_fp8(case, _decode(case, split_tokens=64))


def test_more_splits_than_tokens_leaves_empty_splits_harmless() -> None:
    case = make_case([5, 3], [1, 1], 2, 1, head_dim=16, cache_dtype=FP8_DTYPE)
    _check_fp8(case, _decode(case, split_tokens=1, max_splits=8))


def test_results_do_not_depend_on_the_batch() -> None:
    # The crowd's longest sequence needs more splits than the one checked: another grid.
    crowd = make_case([140, 9, 300], [1, 1, 1], 4, 2, head_dim=32, cache_dtype=FP8_DTYPE)
    table = crowd.md.block_tables[0, :9].tolist()
    alone = AttentionMetadata.from_lists([140], [1], [table], 16, DEVICE)
    together = _decode(crowd, split_tokens=64)[0]
    by_itself = paged_decode(crowd.q[:1], crowd.cache, alone.seq_lens, alone.block_tables,
                             alone.max_seq_len, crowd.scale, split_tokens=64)[0]  # fmt: skip
    assert torch.equal(together, by_itself)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_unquantized_cache_variants(cache_dtype: torch.dtype) -> None:
    case = make_case([40, 17], [1, 1], 4, 2, head_dim=48, cache_dtype=cache_dtype)
    out = _decode(case)
    torch.testing.assert_close(out.double(), expected_output(case), atol=1e-4, rtol=0)


def test_bf16_queries_on_fp8_cache() -> None:
    case = make_case([50], [1], 4, 1, head_dim=64, cache_dtype=FP8_DTYPE, q_dtype=torch.bfloat16)
    out = _decode(case)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected_output(case), atol=2e-2, rtol=0)
