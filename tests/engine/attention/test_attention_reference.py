"""The PyTorch paged attention against plain dense attention."""

import pytest
import torch
from attention_cases import expected_output, make_case

from kvgate.engine.attention import AttentionMetadata, paged_attention


@pytest.mark.parametrize("num_heads,kv_heads", [(4, 4), (4, 2), (8, 1)])
def test_mixed_prefill_and_decode_matches_dense(num_heads: int, kv_heads: int) -> None:
    case = make_case([7, 40, 1, 33, 16], [7, 1, 1, 5, 1], num_heads, kv_heads)
    out = paged_attention(case.q, case.cache, case.md, case.scale)
    torch.testing.assert_close(out.double(), expected_output(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seq_len", [1, 15, 16, 17, 48, 97])
def test_decode_at_block_boundaries(seq_len: int) -> None:
    case = make_case([seq_len, 5], [1, 1], head_dim=24)
    out = paged_attention(case.q, case.cache, case.md, case.scale)
    torch.testing.assert_close(out.double(), expected_output(case), atol=1e-5, rtol=1e-5)


def test_chunked_prefill_ignores_slots_past_the_chunk_end() -> None:
    # The context stops mid-block; the rest of that block holds large garbage.
    case = make_case([37], [21], block_size=16)
    out = paged_attention(case.q, case.cache, case.md, case.scale)
    torch.testing.assert_close(out.double(), expected_output(case), atol=1e-5, rtol=1e-5)


def test_prefill_only_batch_with_full_prompts() -> None:
    case = make_case([16, 3, 30], [16, 3, 30], num_heads=6, kv_heads=3)
    out = paged_attention(case.q, case.cache, case.md, case.scale)
    torch.testing.assert_close(out.double(), expected_output(case), atol=1e-5, rtol=1e-5)


def test_bf16_cache_keeps_query_dtype_and_stays_close() -> None:
    case = make_case([50, 9], [1, 9], cache_dtype=torch.bfloat16, q_dtype=torch.bfloat16)
    out = paged_attention(case.q, case.cache, case.md, case.scale)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected_output(case), atol=2e-2, rtol=2e-2)


def test_fp8_cache_matches_dequantized_and_unquantized_attention() -> None:
    case = make_case(
        [70, 18, 5], [1, 6, 1], num_heads=8, kv_heads=2, cache_dtype=torch.float8_e4m3fn
    )
    out = paged_attention(case.q, case.cache, case.md, case.scale).double()
    torch.testing.assert_close(out, expected_output(case), atol=1e-5, rtol=1e-5)
    exact = expected_output(case, dequantized=False)
    assert ((out - exact).norm() / exact.norm()).item() < 0.05


def test_decode_rows_do_not_depend_on_batch_companions() -> None:
    crowd = make_case([40, 90, 4], [1, 1, 1], seed=3)
    table = crowd.md.block_tables[0, :3].tolist()
    alone = AttentionMetadata.from_lists([40], [1], [table], block_size=16)
    out_crowd = paged_attention(crowd.q, crowd.cache, crowd.md, crowd.scale)[:1]
    out_alone = paged_attention(crowd.q[:1], crowd.cache, alone, crowd.scale)
    torch.testing.assert_close(out_alone, out_crowd, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize(
    "seq_lens,query_lens",
    [
        # Full prompts (plain causal), chunks after a cached prefix (an explicit mask) and a
        # decode row beside them; then a decode-only step with padded, ragged contexts.
        ([40, 70, 25, 33], [40, 21, 1, 5]),
        ([40, 70, 1, 33, 17], [1, 1, 1, 1, 1]),
    ],
)
def test_fused_bf16_attention_matches_dense_and_the_tiled_path(
    window: int | None, seq_lens: list[int], query_lens: list[int]
) -> None:
    case = make_case(
        seq_lens, query_lens, num_heads=8, kv_heads=2,
        cache_dtype=torch.bfloat16, q_dtype=torch.bfloat16,
    )  # fmt: skip
    fused = paged_attention(case.q, case.cache, case.md, case.scale, window, fused=True)
    tiled = paged_attention(case.q, case.cache, case.md, case.scale, window)
    assert fused.dtype == torch.bfloat16
    torch.testing.assert_close(
        fused.double(), expected_output(case, window=window), atol=2e-2, rtol=2e-2
    )
    torch.testing.assert_close(fused, tiled, atol=2e-2, rtol=2e-2)


def test_fused_attention_leaves_fp32_and_softcapped_layers_on_the_tiled_path() -> None:
    case = make_case([30, 12, 9], [30, 4, 1])
    fused = paged_attention(case.q, case.cache, case.md, case.scale, fused=True)
    assert torch.equal(fused, paged_attention(case.q, case.cache, case.md, case.scale))
    bf16 = make_case([30, 9], [30, 1], cache_dtype=torch.bfloat16, q_dtype=torch.bfloat16)
    capped = paged_attention(bf16.q, bf16.cache, bf16.md, bf16.scale, softcap=5.0)
    same = paged_attention(bf16.q, bf16.cache, bf16.md, bf16.scale, softcap=5.0, fused=True)
    assert torch.equal(capped, same)
