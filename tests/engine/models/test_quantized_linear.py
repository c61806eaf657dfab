"""The quantized matmul kernels (`kvgate.engine.models.quant.qgemm`) against fp64 products of gguf's
own dequantized weights (`gguf.quants.dequantize`), for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 and the
K-quants Q4_K/Q5_K/Q6_K, bf16
and fp32 activations, 1..33 rows, an odd number of outputs and a multiple of 8 (Q4_0, Q4_1 and
Q8_0 rows then interleaved in groups of 8 where the build computes them so), the native build and
the forced AVX2 one; and weights of mixed types stacked as one (a Q4_K_M file's q, k and v).

The kernel quantizes each activation row to int16 per 32-block, so two references: the
exact one quantizes the activations the same way (fp32 ``amax / 32767``, round
half to even) and must match to fp32 summation error; the plain one takes the activations as
they are, and the difference must stay within the bound the activation rounding allows,
``sum_b dx_b / 2 * sum_i |w_bi|`` per output.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kvgate.engine.models import quantized_linear as ql
from kvgate.engine.models.quantized_linear import QuantizedLinear, StackedLinear, concat
from tests.engine.kernel_variants import ops_for

Q = GGMLQuantizationType
TYPES = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
OUT, IN = 37, 96  # an odd number of outputs; three blocks per row
INTERLEAVED = 256  # a ggml type id plus this: its blocks in qgemm's interleaved layout
K_IN = 512  # the K-quants: two super-blocks of 256 per row
# Where each K-quant super-block keeps its fp16 scales (the rest: quants and sub-scales).
K_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _inputs(qtype: Q) -> int:
    return K_IN if qtype in K_SCALES else IN


@pytest.fixture(scope="module", params=["native", "avx2"])
def kernels(request: pytest.FixtureRequest) -> Any:
    """This machine's library, and its AVX2 variant (``KVGATE_CPU_ISA=avx2``)."""
    ops = ops_for(request.param)
    assert request.param != "avx2" or ops.isa() == "avx2"
    return ops


@pytest.fixture(params=[OUT, 40], ids=["37-outputs", "40-outputs"])
def out(request: pytest.FixtureRequest) -> int:
    """Outputs: 37 (every type in the file's layout) or 40 (Q4_0, Q4_1, Q8_0 interleaved where
    the build has vectors)."""
    return int(request.param)


def _weight(qtype: Q, out: int = OUT, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of a random weight, and those blocks dequantized by gguf (fp64). gguf quantizes
    no K-quant: those are random super-blocks with small finite fp16 scales (every quant and
    sub-scale bit pattern occurs)."""
    rng = np.random.default_rng(seed)
    if qtype not in K_SCALES:
        values = rng.standard_normal((out, IN)).astype(np.float32) * 0.1
        blocks = quantize(values, qtype)
    else:
        block, size = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, (out, K_IN // block, size), np.uint8)
        for offset in K_SCALES[qtype]:
            scale = rng.uniform(1e-4, 2e-3, (out, K_IN // block)).astype(np.float16)
            blocks[..., offset : offset + 2] = scale[..., None].view(np.uint8)
        blocks = blocks.reshape(out, -1)
    return blocks, dequantize(blocks, qtype).astype(np.float64)


def _linear(kernels: Any, qtype: Q, blocks: np.ndarray) -> QuantizedLinear:
    return QuantizedLinear(torch.from_numpy(blocks.copy()), int(qtype), _inputs(qtype), kernels)


def _quantized_activations(x: np.ndarray) -> np.ndarray:
    """``x`` (fp32) as the kernel sees it: int16 per 32-block times the block's fp32 scale."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    d = np.abs(blocks).max(-1, keepdims=True) / np.float32(32767)
    inv = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    quantized: np.ndarray = np.rint(blocks * inv) * d.astype(np.float64)
    return quantized.reshape(x.shape)


def _activation_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per output, the most the activation rounding can move it: sum_b dx_b/2 * sum |w_b|."""
    half_step = np.abs(x.reshape(x.shape[0], -1, 32)).max(-1) / 32767 / 2  # [M, blocks]
    weight = np.abs(w.reshape(w.shape[0], -1, 32)).sum(-1)  # [N, blocks]
    bound: np.ndarray = half_step @ weight.T
    return bound


def _close(got: torch.Tensor, want: np.ndarray, scale: np.ndarray, dtype: torch.dtype) -> None:
    """fp32 sums (relative 1e-5 of the terms' magnitude) and one rounding to ``dtype``."""
    rounding = 2**-8 if dtype == torch.bfloat16 else 0.0
    tol = 1e-5 * scale + rounding * np.abs(want) + 1e-7
    err = np.abs(got.double().numpy() - want)
    assert (err <= tol).all(), (
        f"worst {err.max():.3g} (tolerance there {tol.flat[err.argmax()]:.3g})"
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_match_the_dequantized_weights_for_1_to_33_rows(
    kernels: Any, qtype: Q, dtype: torch.dtype, out: int
) -> None:
    blocks, w = _weight(qtype, out)
    layer = _linear(kernels, qtype, blocks)
    for rows in range(1, 34):
        x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
        x64 = x.double().numpy()
        got = layer.linear(x)
        assert got.dtype == dtype and got.shape == (rows, out)
        exact = _quantized_activations(x.float().numpy()) @ w.T
        _close(got, exact, np.abs(x64) @ np.abs(w).T, dtype)
        plain = x64 @ w.T
        bound = _activation_bound(x64, w) + 1e-5 * (np.abs(x64) @ np.abs(w).T)
        bound += (2**-8 if dtype == torch.bfloat16 else 0.0) * np.abs(plain)
        assert (np.abs(got.double().numpy() - plain) <= bound).all()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_epilogues_bias_residual_swiglu_and_fp32_logits(kernels: Any, qtype: Q, out: int) -> None:
    blocks, w = _weight(qtype, out)
    layer = _linear(kernels, qtype, blocks)
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(7))
    xq = _quantized_activations(x.numpy())
    scale = np.abs(x.double().numpy()) @ np.abs(w).T
    bias, residual = torch.randn(out), torch.randn(5, out)
    _close(layer.linear(x, bias), xq @ w.T + bias.double().numpy(), scale, torch.float32)
    summed = layer.linear_add(x, residual)
    _close(summed, xq @ w.T + residual.double().numpy(), scale, torch.float32)
    logits = layer.linear(x.bfloat16(), float_out=True)
    assert logits.dtype == torch.float32
    xq16 = _quantized_activations(x.bfloat16().float().numpy())
    _close(logits, xq16 @ w.T, scale, torch.float32)

    up_blocks, up = _weight(qtype, out, seed=1)
    gate_up = concat([layer, _linear(kernels, qtype, up_blocks)])
    assert gate_up.out_features == 2 * out
    gate = torch.from_numpy(xq @ w.T)
    want = (F.silu(gate) * torch.from_numpy(xq @ up.T)).numpy()
    _close(gate_up.linear_gated(x, "silu"), want, scale * (1 + np.abs(xq @ up.T)), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_embedding_rows_are_gguf_dequantized_rows(
    kernels: Any, qtype: Q, dtype: torch.dtype, out: int
) -> None:
    blocks, w = _weight(qtype, out)
    ids = torch.tensor([[3, 0], [out - 1, 3]])
    rows = _linear(kernels, qtype, blocks).embedding(ids, dtype)
    assert rows.shape == (2, 2, w.shape[1]) and rows.dtype == dtype
    want = torch.from_numpy(w[ids.numpy()]).to(dtype)
    assert torch.allclose(rows.double(), want.double(), rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="out of range"):
        _linear(kernels, qtype, blocks).embedding(torch.tensor([out]), dtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_a_row_gets_the_same_bits_alone_or_with_other_rows(
    kernels: Any, qtype: Q, out: int
) -> None:
    """What speculative decoding's exactness rests on: a step verifying drafted tokens
    multiplies several rows at once, and each must come out as a one-row decode step's."""
    layer = _linear(kernels, qtype, _weight(qtype, out)[0])
    x = torch.randn(13, _inputs(qtype), generator=torch.Generator().manual_seed(11))
    alone = torch.cat([layer.linear(x[i : i + 1]) for i in range(13)])
    assert torch.equal(layer.linear(x), alone)
    gate_up = concat([layer, layer])
    alone = torch.cat([gate_up.linear_gated(x[i : i + 1], "silu") for i in range(13)])
    assert torch.equal(gate_up.linear_gated(x, "silu"), alone)


def test_rows_in_groups_of_8_are_interleaved_where_vectors_compute_them(kernels: Any) -> None:
    """The AVX2 and AVX-512 builds keep Q4_0, Q4_1 and Q8_0 weights whose rows come in groups
    of 8 interleaved (the layout their products are fastest on); every other weight, and every
    weight on a build without vectors (``host`` on a CPU without AVX2), keeps the file's."""
    interleaves = kernels.isa() != "host"
    for qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        layer = _linear(kernels, qtype, _weight(qtype, 40)[0])
        assert layer.layout == qtype + (INTERLEAVED if interleaves else 0)
        assert layer.nbytes == _weight(qtype, 40)[0].nbytes
        assert _linear(kernels, qtype, _weight(qtype, OUT)[0]).layout == qtype
    assert _linear(kernels, Q.Q4_K, _weight(Q.Q4_K, 40)[0]).layout == Q.Q4_K


def test_mismatched_blocks_are_refused(kernels: Any) -> None:
    blocks, _ = _weight(Q.Q4_1)
    with pytest.raises(ValueError, match="do not hold 64 inputs"):
        QuantizedLinear(torch.from_numpy(blocks), int(Q.Q4_1), 64, kernels)
    with pytest.raises(ValueError, match="not one the quantized kernels compute"):
        QuantizedLinear(torch.from_numpy(blocks), int(Q.Q2_K), IN, kernels)
    layer = _linear(kernels, Q.Q4_1, blocks)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        layer.linear(torch.randn(2, IN - 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_prefill_sized_batches_multiply_the_dequantized_weight(
    kernels: Any, qtype: Q, dtype: torch.dtype, out: int
) -> None:
    """From DENSE_ROWS rows on: the weight dequantized (as gguf does) and a dense product.
    bf16: the dequantized weight is rounded to bf16 (2^-8 relative per value: up to 2^-8 of
    sum |x||w|), and the result once or twice more (the product, the epilogue)."""
    blocks, w = _weight(qtype, out)
    layer = _linear(kernels, qtype, blocks)
    assert torch.equal(layer.dense(dtype), torch.from_numpy(w).to(dtype))
    rows = ql.DENSE_ROWS + 5
    x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(3)).to(dtype)
    x64 = x.double().numpy()
    scale = np.abs(x64) @ np.abs(w).T
    step = 2**-8 if dtype == torch.bfloat16 else 1e-6

    def close(got: torch.Tensor, want: np.ndarray, magnitude: np.ndarray) -> None:
        tol = step * (magnitude + 2 * np.abs(want)) + 1e-6
        assert (np.abs(got.double().numpy() - want) <= tol).all()

    plain = x64 @ w.T
    close(layer.linear(x), plain, scale)
    residual = torch.randn(rows, out).to(dtype)
    close(layer.linear_add(x, residual), plain + residual.double().numpy(), scale)
    gate = torch.from_numpy(plain)
    swiglu = (F.silu(gate) * gate).numpy()
    close(concat([layer, layer]).linear_gated(x, "silu"), swiglu, scale * (1 + 2 * np.abs(plain)))


def test_weights_of_mixed_types_stack_into_one_handle(kernels: Any) -> None:
    """q and k of one type and v of another (a Q4_K_M file's Q6_K v): one product per run of
    one type, side by side, with the fused epilogues applied over the whole."""
    kinds = [Q.Q4_K, Q.Q4_K, Q.Q6_K]
    weights = [_weight(qtype, seed=seed) for seed, qtype in enumerate(kinds)]
    stacked = concat(
        [_linear(kernels, qtype, b) for qtype, (b, _) in zip(kinds, weights, strict=True)]
    )
    assert isinstance(stacked, StackedLinear)
    assert [p.qtype for p in stacked.parts] == [Q.Q4_K, Q.Q6_K]
    w = np.concatenate([w for _, w in weights])
    x = torch.randn(3, K_IN, generator=torch.Generator().manual_seed(5))
    x64, xq = x.double().numpy(), _quantized_activations(x.numpy())
    scale = np.abs(x64) @ np.abs(w).T
    bias, residual = torch.randn(3 * OUT), torch.randn(3, 3 * OUT)
    _close(stacked.linear(x, bias), xq @ w.T + bias.double().numpy(), scale, torch.float32)
    summed = stacked.linear_add(x, residual)
    _close(summed, xq @ w.T + residual.double().numpy(), scale, torch.float32)
    assert torch.equal(stacked.dense(torch.float32), torch.from_numpy(w).float())

    (gate_blocks, gate_w), (up_blocks, up_w) = weights[0], weights[2]
    gate_up = concat([_linear(kernels, Q.Q4_K, gate_blocks), _linear(kernels, Q.Q6_K, up_blocks)])
    gate, up = torch.from_numpy(xq @ gate_w.T), torch.from_numpy(xq @ up_w.T)
    want = (F.silu(gate) * up).numpy()
    magnitude = (np.abs(x64) @ np.abs(gate_w).T) * (1 + up.abs().numpy())
    magnitude += (np.abs(x64) @ np.abs(up_w).T) * F.silu(gate).abs().numpy()
    _close(gate_up.linear_gated(x, "silu"), want, magnitude, torch.float32)
