"""The small-batch GEMM kernel (`kvgate.engine.models.gemm`) against fp64 products, on this machine's
library and on every other variant it runs (AVX2 on any x86); and the oneDNN and plain handles behind the same interface."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import kvgate.engine.models.gemm as gemm
import kvgate.engine.native as native
from kvgate.engine.native_variants import BY_NAME
from tests.engine.kernel_variants import ops_for

Kernel = Callable[[torch.Tensor, bool], gemm.NativeLinear]


@pytest.fixture(scope="module", params=["native", *BY_NAME])
def make(request: pytest.FixtureRequest) -> Kernel:
    """`NativeLinear` over this machine's library (AMX tiles where it has them), and over each
    other variant its CPU runs: the vector paths (``avx512bf16``: vdpbf16ps without AMX,
    ``avx512``, ``avx2``: AVX2 + FMA, bf16 widened to fp32)."""
    ops = ops_for(request.param)
    if request.param == "avx2":
        assert ops.gemm_layout() == (8, True)  # 8-wide fp32 vectors, bf16 pairs widened
    return lambda weight, gated: gemm.NativeLinear(ops, weight, gated)


# Inputs are exact in their dtype and sums run in fp32: bf16 is off by its one final rounding.
TOLERANCE = {torch.bfloat16: dict(rtol=2**-8, atol=1e-4), torch.float32: dict(rtol=1e-5, atol=1e-5)}
ROWS = [1, 2, 3, 5, 8, 9, 16, 17, 31, 33, 64]
# out, in: odd, K a multiple of AMX's 32 (96 and 1000 x 320 take the tiles from 8 rows), and
# many threads' worth
SHAPES = [(96, 64), (37, 29), (50, 33), (1000, 300), (1000, 320)]


def _case(rows: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weight = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    bias, residual = torch.randn(n, generator=gen), torch.randn(rows, n, generator=gen)
    return x, weight, bias.to(dtype), residual.to(dtype)


def _check(out: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == dtype and out.shape == expected.shape and out.is_contiguous()
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_linear_bias_and_residual_match_fp64(
    make: Kernel, dtype: torch.dtype, n: int, k: int, rows: int
) -> None:
    x, weight, bias, residual = _case(rows, n, k, dtype, seed=rows * n + k)
    exact = x.double() @ weight.double().T
    linear = make(weight, False)
    _check(linear.linear(x), exact, dtype)
    _check(linear.linear(x, bias), exact + bias.double(), dtype)
    _check(linear.linear_add(x, residual), exact + residual.double(), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("half,k", [(48, 64), (37, 29), (500, 300)])
@pytest.mark.parametrize("rows", [1, 4, 8, 13, 64])
def test_gate_up_pair_gives_act_gate_times_up_and_both_halves(
    make: Kernel, dtype: torch.dtype, half: int, k: int, rows: int
) -> None:
    x, weight, _, _ = _case(rows, 2 * half, k, dtype, seed=half + rows)
    exact = x.double() @ weight.double().T
    gate, up = exact[:, :half], exact[:, half:]
    pair = make(weight, True)
    _check(pair.linear_gated(x, "silu"), F.silu(gate) * up, dtype)
    _check(pair.linear_gated(x, "gelu"), F.gelu(gate, approximate="tanh") * up, dtype)
    _check(pair.linear(x), exact, dtype)  # [gate | up], for adapters added before the act


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "rows,half,k",
    [
        (65, 40, 72),
        (300, 40, 72),
        (1000, 37, 29),
        (1031, 48, 301),
        (130, 24, 1037),
        (1031, 48, 320),
    ],
)
def test_prefill_sized_row_counts_too(
    make: Kernel, dtype: torch.dtype, rows: int, half: int, k: int
) -> None:
    """No second copy for prefills: the kernel serves them, in row tiles and row blocks (odd
    K and N too, and a K of 1,037)."""
    x, weight, bias, residual = _case(rows, 2 * half, k, dtype, seed=rows)
    exact = x.double() @ weight.double().T
    linear, pair = make(weight, False), make(weight, True)
    _check(linear.linear(x, bias), exact + bias.double(), dtype)
    _check(linear.linear_add(x, residual), exact + residual.double(), dtype)
    _check(pair.linear_gated(x, "silu"), F.silu(exact[:, :half]) * exact[:, half:], dtype)


@pytest.mark.parametrize("k", [301, 320])
@pytest.mark.parametrize("rows", [1, 65, 1000])
def test_bf16_outputs_round_to_nearest_even_as_torch_does(make: Kernel, rows: int, k: int) -> None:
    """Small integers: every product and sum is exact in fp32, so the one rounding to bf16
    (whole panels in vectors, a last partial panel by c10) must be torch's, ties to even
    included; a NaN row stays NaN."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randint(-8, 9, (rows, k), generator=gen).to(torch.bfloat16)
    weight = torch.randint(-8, 9, (70, k), generator=gen).to(torch.bfloat16)
    residual = torch.randint(-300, 301, (rows, 70), generator=gen).to(torch.bfloat16)
    x[-1, 5] = float("nan")
    exact = x.double() @ weight.double().T
    linear = make(weight, False)
    assert torch.equal(linear.linear(x)[:-1], exact.to(torch.bfloat16)[:-1])
    summed = linear.linear_add(x, residual)
    assert torch.equal(summed[:-1], (exact + residual.double()).to(torch.bfloat16)[:-1])
    assert summed[-1].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", SHAPES)
def test_packed_panels_hold_the_weight_once_padded_with_zeros_and_give_its_rows(
    make: Kernel, dtype: torch.dtype, n: int, k: int
) -> None:
    _, weight, _, _ = _case(1, n, k, dtype, seed=n)
    linear = make(weight, False)
    width, panels = linear.width, -(-n // linear.width)
    if linear.pairs:  # [panels, K/2, width * 2]: pairs of k per column
        plain = linear.packed.view(panels, -1, width, 2).permute(0, 2, 1, 3).flatten(2)
    else:  # [panels, K, width]
        plain = linear.packed.transpose(1, 2)
    plain = plain.reshape(panels * width, -1)
    assert torch.equal(plain[:n, :k], weight)
    assert not plain[n:].any() and not plain[:, k:].any()
    ids = torch.tensor([0, n - 1, n // 2, 0])  # the lookup a tied lm_head's copy serves
    rows = linear.rows(ids)
    assert rows.is_contiguous() and torch.equal(rows, F.embedding(ids, weight))
    with pytest.raises(ValueError, match="gate/up"):
        make(weight[: 2 * (n // 2)], True).rows(ids)


def test_zero_rows_and_a_mismatched_weight_are_handled(make: Kernel) -> None:
    x, weight, _, _ = _case(0, 40, 24, torch.bfloat16, seed=1)
    assert make(weight, False).linear(x).shape == (0, 40)
    fp32 = make(weight.float(), False)
    with pytest.raises(RuntimeError, match="dtype"):
        fp32._gemm(torch.ones(2, 24, dtype=torch.bfloat16), fp32.packed, 40, 0, 0, None, None)
    with pytest.raises(RuntimeError, match="K"):
        fp32._gemm(torch.ones(2, 23), fp32.packed, 40, 0, 0, None, None)


@pytest.mark.parametrize("handle", ["onednn", "plain"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fallback_handles_serve_the_same_interface(handle: str, dtype: torch.dtype) -> None:
    """oneDNN's prepacked copy (the kernel not built) and the plain weight (nothing packs it)."""
    if handle == "onednn" and not gemm.pl.packing_helps(torch.empty(1, dtype=dtype)):
        pytest.skip("no oneDNN kernels of this dtype here")
    x, weight, bias, residual = _case(9, 64, 48, dtype, seed=3)
    cls = gemm.OneDnnLinear if handle == "onednn" else gemm.PlainLinear
    linear, pair = cls(weight), cls(weight, gated=True)
    exact = x.double() @ weight.double().T
    tolerance = dict(rtol=2**-7, atol=2e-2) if dtype == torch.bfloat16 else TOLERANCE[dtype]
    for out, expected in (
        (linear.linear(x, bias), exact + bias.double()),
        (linear.linear_add(x, residual), exact + residual.double()),
        (pair.linear_gated(x, "silu"), F.silu(exact[:, :32]) * exact[:, 32:]),
        (pair.linear_gated(x, "gelu"), F.gelu(exact[:, :32], approximate="tanh") * exact[:, 32:]),
        (pair.linear(x), exact),
    ):
        torch.testing.assert_close(out.double(), expected, **tolerance)
    with pytest.raises(ValueError, match="pair"):
        linear.linear_gated(x, "silu")


def test_pack_picks_the_kernel_then_onednn_then_the_plain_weight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weight = torch.randn(32, 16)
    if native.library() is not None:
        assert isinstance(gemm.pack(weight), gemm.NativeLinear)
    monkeypatch.setattr(native, "library", lambda: None)  # as KVGATE_CPU_KERNELS=0 makes it
    assert isinstance(gemm.pack(weight), gemm.OneDnnLinear)
    assert isinstance(gemm.pack(weight.half()), gemm.PlainLinear)
    assert isinstance(gemm.pack(weight.to("meta")), gemm.PlainLinear)
