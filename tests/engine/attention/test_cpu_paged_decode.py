"""The native CPU decode kernel against fp64 dense attention, and wired into the torch backend."""

from __future__ import annotations

import pytest
import torch
from attention_cases import expected_output, make_case

from kvgate.engine.attention import AttentionMetadata, get_attention_backend, paged_attention
from kvgate.engine.attention.cpu import NativeDecode
from kvgate.engine.attention.kv_cache import FP8_DTYPE, KVCache
from tests.engine.kernel_variants import ops_for


@pytest.fixture(scope="module", params=["native", "avx2"])
def isa(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def kernel(isa: str) -> NativeDecode:
    """The kernel of this machine's library, and of its AVX2 variant (``KVGATE_CPU_ISA=avx2``:
    the library a Zen 3 loads) on any x86 machine that has AVX2 and FMA."""
    return NativeDecode(ops_for(isa))


def _decode(kernel: NativeDecode, case, window=None, softcap=None) -> torch.Tensor:  # type: ignore[no-untyped-def]
    md = case.md
    return kernel(case.q, case.cache, md.block_tables, md.seq_lens, case.scale, window, softcap)


# bf16: the output is rounded once to bf16 from fp32 sums (the reference rounds scores too).
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}
EVERY_CACHE = pytest.mark.parametrize(
    "cache_dtype,q_dtype",
    [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (FP8_DTYPE, torch.bfloat16)],
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,kv_heads", [(4, 4), (4, 2), (8, 1), (10, 2)])
def test_gqa_ratios(
    kernel: NativeDecode, dtype: torch.dtype, num_heads: int, kv_heads: int
) -> None:
    case = make_case([33, 5], [1, 1], num_heads, kv_heads, 64, cache_dtype=dtype, q_dtype=dtype)
    out = _decode(kernel, case)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected_output(case), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 80, 96, 128, 256])
def test_head_sizes(kernel: NativeDecode, head_dim: int, dtype: torch.dtype) -> None:
    """bf16 heads of a multiple of 32 run on vdpbf16ps where the build has it (keys paired
    across odd runs of a block), the others widened: both against the same reference."""
    case = make_case([40, 17], [1, 1], 8, 2, head_dim, cache_dtype=dtype, q_dtype=dtype)
    torch.testing.assert_close(
        _decode(kernel, case).double(), expected_output(case), atol=TOLERANCE[dtype], rtol=0
    )


def test_block_boundaries_in_shuffled_blocks_ignore_the_garbage_around_them(
    kernel: NativeDecode,
) -> None:
    case = make_case([1, 15, 16, 17, 300], [1] * 5, 4, 2, 64)
    torch.testing.assert_close(
        _decode(kernel, case).double(), expected_output(case), atol=2e-5, rtol=0
    )


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_with_its_per_token_scales(kernel: NativeDecode, q_dtype: torch.dtype) -> None:
    """Against attention over the dequantized cache (what it stores), and near the unquantized."""
    case = make_case([1, 15, 17, 90], [1] * 4, 8, 2, 64, cache_dtype=FP8_DTYPE, q_dtype=q_dtype)
    out = _decode(kernel, case).double()
    torch.testing.assert_close(out, expected_output(case), atol=TOLERANCE[q_dtype], rtol=0)
    exact = expected_output(case, dequantized=False)
    assert ((out - exact).norm() / exact.norm()).item() < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window,softcap", [(7, None), (None, 30.0), (20, 5.0)])
def test_sliding_window_and_softcap(kernel: NativeDecode, window, softcap, dtype) -> None:  # type: ignore[no-untyped-def]
    """Windows start mid-block, at odd keys: bf16 pairs end on a zero row, never a neighbour's."""
    case = make_case([50, 9, 33], [1, 1, 1], 4, 2, 64, cache_dtype=dtype, q_dtype=dtype)
    want = expected_output(case, window=window, softcap=softcap)
    torch.testing.assert_close(
        _decode(kernel, case, window, softcap).double(), want, atol=TOLERANCE[dtype], rtol=0
    )


def test_a_sequence_gets_the_same_bits_alone_and_in_a_crowd(kernel: NativeDecode) -> None:
    crowd = make_case([140, 9, 300], [1, 1, 1], 4, 2, 64, cache_dtype=torch.bfloat16,
                      q_dtype=torch.bfloat16)  # fmt: skip
    table = crowd.md.block_tables[0, :9].tolist()
    alone = AttentionMetadata.from_lists([140], [1], [table], 16)
    by_itself = kernel(crowd.q[:1], crowd.cache, alone.block_tables, alone.seq_lens,
                       crowd.scale, None, None)  # fmt: skip
    assert torch.equal(_decode(kernel, crowd)[0], by_itself[0])


@EVERY_CACHE
def test_many_sequences_read_whole_blocks_and_keep_each_ones_bits(
    kernel: NativeDecode, cache_dtype: torch.dtype, q_dtype: torch.dtype
) -> None:
    """Where sequences outnumber the threads, a work item walks all its KV heads' rows of a
    block together: each sequence still gets its own answer, bit for bit the one it gets alone
    (one head at a time)."""
    lens = [40, 17, 3, 64, 33, 16, 90, 1]
    case = make_case(lens, [1] * 8, 8, 4, 64, cache_dtype=cache_dtype, q_dtype=q_dtype)
    out = _decode(kernel, case)
    torch.testing.assert_close(out.double(), expected_output(case), atol=TOLERANCE[q_dtype], rtol=0)
    for i in (0, 6):
        table = case.md.block_tables[i, : -(-lens[i] // 16)].tolist()
        alone = AttentionMetadata.from_lists([lens[i]], [1], [table], 16)
        by_itself = kernel(case.q[i : i + 1], case.cache, alone.block_tables, alone.seq_lens,
                           case.scale, None, None)  # fmt: skip
        assert torch.equal(out[i], by_itself[0])


@EVERY_CACHE
def test_rows_of_one_sequence_at_consecutive_positions_keep_each_ones_bits(
    kernel: NativeDecode, cache_dtype: torch.dtype, q_dtype: torch.dtype
) -> None:
    """A step verifying drafted tokens asks for one sequence at 11 consecutive positions (across
    a block boundary) beside another sequence: the rows walk the blocks together, and each
    gets the bits it gets alone, with and without a softcap; with a window they walk apart."""
    case = make_case([70, 45], [1, 1], 8, 2, 64, cache_dtype=cache_dtype, q_dtype=q_dtype)
    tables = [case.md.block_tables[0, :5].tolist()] * 11 + [case.md.block_tables[1, :3].tolist()]
    lens = [60 + i for i in range(11)] + [45]
    md = AttentionMetadata.from_lists(lens, [1] * 12, tables, 16)
    q = torch.randn(12, 8, 64, generator=torch.Generator().manual_seed(4)).to(q_dtype)
    for window, softcap in ((None, None), (None, 30.0), (20, None)):
        together = kernel(q, case.cache, md.block_tables, md.seq_lens, case.scale, window, softcap)
        for i in range(12):
            alone = AttentionMetadata.from_lists([lens[i]], [1], [tables[i]], 16)
            by_itself = kernel(q[i : i + 1], case.cache, alone.block_tables, alone.seq_lens,
                               case.scale, window, softcap)  # fmt: skip
            assert torch.equal(together[i], by_itself[0]), (i, window, softcap)


def test_bad_tables_are_refused_not_read(kernel: NativeDecode) -> None:
    case = make_case([20], [1], 4, 2, 64)
    md = case.md
    beyond = md.block_tables.clone()
    beyond[0, 0] = case.cache.k.shape[0]
    with pytest.raises(RuntimeError, match="block id out of range"):
        kernel(case.q, case.cache, beyond, md.seq_lens, case.scale, None, None)
    too_long = md.seq_lens + 16 * md.block_tables.shape[1]
    with pytest.raises(RuntimeError, match="seq_len out of range"):
        kernel(case.q, case.cache, md.block_tables, too_long, case.scale, None, None)


def test_takes_only_what_it_was_built_for(kernel: NativeDecode) -> None:
    bf16 = make_case([5], [1], 4, 2, 64, cache_dtype=torch.bfloat16, q_dtype=torch.bfloat16)
    assert kernel.takes(bf16.q, bf16.cache)
    assert not kernel.takes(bf16.q.float(), bf16.cache)  # dtypes differ
    fp8 = make_case([5], [1], 4, 2, 64, cache_dtype=FP8_DTYPE)
    assert kernel.takes(fp8.q, fp8.cache) and kernel.takes(fp8.q.bfloat16(), fp8.cache)
    assert not kernel.takes(fp8.q.half(), fp8.cache)
    odd = make_case([5], [1], 4, 2, 72)
    assert not kernel.takes(odd.q, odd.cache)


def test_the_cpu_backend_serves_decode_rows_with_it_beside_prefill_rows(
    kernel: NativeDecode, isa: str
) -> None:
    """A mixed step: the decode rows match the kernel's own answer, the prefill rows (the
    native prefill kernel's, `test_cpu_paged_prefill`) the reference's, and all of it the
    dense oracle."""
    if isa != "native":
        pytest.skip("the backend serves the build for this machine")
    backend = get_attention_backend("torch", "cpu")
    case = make_case([30, 64, 7], [1, 20, 1], 4, 2, 64)
    got = backend.paged_attention(case.q, case.cache, case.md, case.scale)
    torch.testing.assert_close(got.double(), expected_output(case), atol=2e-5, rtol=0)
    reference = paged_attention(case.q, case.cache, case.md, case.scale)
    torch.testing.assert_close(got[1:21], reference[1:21], atol=2e-5, rtol=0)
    decode_rows = torch.tensor([0, 21])
    alone = kernel(case.q[decode_rows], case.cache, case.md.block_tables[[0, 2]],
                   case.md.seq_lens[[0, 2]], case.scale, None, None)  # fmt: skip
    assert torch.equal(got[decode_rows], alone)
    decode_only = make_case([30, 7], [1, 1], 4, 2, 64, seed=3)
    assert torch.equal(
        backend.paged_attention(
            decode_only.q, decode_only.cache, decode_only.md, decode_only.scale
        ),
        _decode(kernel, decode_only),
    )


def test_every_finite_fp8_value_widens_exactly(kernel: NativeDecode) -> None:
    """One key per sequence: the output is its value row times its scale, so each byte's fp32
    value is seen as it left the kernel's widening (NaN bytes excluded: the cache holds none)."""
    finite = [b for b in range(256) if b not in (0x7F, 0xFF)]
    rows = -(-len(finite) // 64)
    values = torch.tensor(finite + [0] * (rows * 64 - len(finite)), dtype=torch.uint8)
    shape = (rows + 1, 1, 16, 64)
    v = torch.zeros(shape, dtype=torch.uint8)
    v[1:, 0, 0] = values.view(rows, 64)
    k = torch.zeros(shape, dtype=torch.uint8)
    ones = torch.ones(rows + 1, 1, 16)
    cache = KVCache(k.view(FP8_DTYPE), v.view(FP8_DTYPE), ones, ones.clone())
    md = AttentionMetadata.from_lists([1] * rows, [1] * rows, [[b] for b in range(1, rows + 1)], 16)
    out = kernel(torch.randn(rows, 1, 64), cache, md.block_tables, md.seq_lens, 0.125, None, None)
    assert torch.equal(out.reshape(-1), values.view(FP8_DTYPE).float())
