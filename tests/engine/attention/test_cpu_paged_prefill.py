"""The native fused prefill kernel against fp64 dense attention, and wired into the torch backend."""

from __future__ import annotations

import pytest
import torch
from attention_cases import PagedCase, expected_output, make_case

from kvgate.engine.attention import get_attention_backend, paged_attention
from kvgate.engine.attention.cpu import NativePrefill
from kvgate.engine.attention.kv_cache import FP8_DTYPE
from kvgate.engine.config import cpu_flags
from tests.engine.kernel_variants import ops_for


@pytest.fixture(scope="module", params=["native", "avx2"])
def isa(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def kernel(isa: str) -> NativePrefill:
    """The kernel of this machine's library, and of its AVX2 variant (``KVGATE_CPU_ISA=avx2``)
    on any x86 machine that has AVX2 and FMA."""
    found = NativePrefill(ops_for(isa))
    assert isa != "avx2" or not found.bf16_dot
    return found


def _prefill(
    kernel: NativePrefill, case: PagedCase, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Every sequence of the case through the kernel (decode rows included: one query)."""
    out = torch.full_like(case.q, float("nan"))
    seqs = torch.arange(len(case.query_lens), dtype=torch.int32)
    kernel(case.q, case.cache, case.md, seqs, case.scale, window, softcap, out)
    return out


# bf16: scores from bf16 products, weights rounded to bf16 once, the output rounded to bf16.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("prompt", [1, 17, 300])
def test_whole_prompts_gqa(
    kernel: NativePrefill, dtype: torch.dtype, head_dim: int, prompt: int
) -> None:
    case = make_case([prompt], [prompt], 8, 2, head_dim, cache_dtype=dtype, q_dtype=dtype)
    out = _prefill(kernel, case)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expected_output(case), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_chunks_after_a_cached_prefix(
    kernel: NativePrefill, dtype: torch.dtype, num_heads: int, kv_heads: int
) -> None:
    """n_q < seq_len: the chunk's queries are the last positions; contexts end mid-block,
    the rest of the block holding large garbage."""
    case = make_case(
        [37, 300, 129], [21, 90, 2], num_heads, kv_heads, 64, cache_dtype=dtype, q_dtype=dtype
    )
    torch.testing.assert_close(
        _prefill(kernel, case).double(), expected_output(case), atol=TOLERANCE[dtype], rtol=0
    )


@pytest.mark.parametrize("window,softcap", [(7, None), (None, 30.0), (40, 5.0)])
def test_sliding_window_and_softcap(kernel: NativePrefill, window, softcap) -> None:  # type: ignore[no-untyped-def]
    case = make_case([100, 60], [100, 25], 4, 2, 64)
    want = expected_output(case, window=window, softcap=softcap)
    torch.testing.assert_close(
        _prefill(kernel, case, window, softcap).double(), want, atol=2e-5, rtol=0
    )


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_with_its_per_token_scales(kernel: NativePrefill, q_dtype: torch.dtype) -> None:
    case = make_case([70, 18], [70, 6], 8, 2, 64, cache_dtype=FP8_DTYPE, q_dtype=q_dtype)
    out = _prefill(kernel, case).double()
    torch.testing.assert_close(out, expected_output(case), atol=TOLERANCE[q_dtype], rtol=0)


def test_only_the_served_sequences_rows_are_written(kernel: NativePrefill) -> None:
    case = make_case([30, 9, 40], [30, 1, 12], 4, 2, 64)
    out = torch.full_like(case.q, float("nan"))
    kernel(case.q, case.cache, case.md, torch.tensor([0, 2], dtype=torch.int32), case.scale,
           None, None, out)  # fmt: skip
    assert torch.isnan(out[30]).all() and not torch.isnan(out[:30]).any()
    torch.testing.assert_close(out[31:].double(), expected_output(case)[31:], atol=2e-5, rtol=0)


def test_bad_tables_are_refused_not_read(kernel: NativePrefill) -> None:
    case = make_case([20], [20], 4, 2, 64)
    case.md.block_tables[0, 0] = case.cache.k.shape[0]
    with pytest.raises(RuntimeError, match="block id out of range"):
        _prefill(kernel, case)


def test_takes_only_what_it_was_built_for(kernel: NativePrefill) -> None:
    bf16 = make_case([5], [5], 4, 2, 64, cache_dtype=torch.bfloat16, q_dtype=torch.bfloat16)
    assert kernel.takes(bf16.q, bf16.cache)
    assert not kernel.takes(bf16.q.float(), bf16.cache)
    odd = make_case([5], [5], 4, 2, 72)
    assert not kernel.takes(odd.q, odd.cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_backend_serves_prefill_rows_with_it_beside_decode_rows(
    kernel: NativePrefill, isa: str, dtype: torch.dtype
) -> None:
    """A mixed step (prompts, a chunk after a prefix, decode rows): the prefill rows are the
    kernel's own answer (bf16 ones SDPA's where the CPU has AMX), all of it the dense oracle's."""
    if isa != "native":
        pytest.skip("the backend serves the build for this machine")
    backend = get_attention_backend("torch", "cpu")
    case = make_case(
        [30, 64, 7, 300, 17], [1, 20, 1, 300, 17], 8, 2, 64, cache_dtype=dtype, q_dtype=dtype
    )
    got = backend.paged_attention(case.q, case.cache, case.md, case.scale)
    torch.testing.assert_close(got.double(), expected_output(case), atol=TOLERANCE[dtype], rtol=0)
    if dtype == torch.float32 or "amx_bf16" not in cpu_flags():  # else SDPA's (`cpu_backend`)
        assert torch.equal(got[1:21], _prefill(kernel, case)[1:21])
        assert torch.equal(got[22:], _prefill(kernel, case)[22:])
    reference = paged_attention(case.q, case.cache, case.md, case.scale)
    torch.testing.assert_close(got, reference, atol=TOLERANCE[dtype], rtol=0)
