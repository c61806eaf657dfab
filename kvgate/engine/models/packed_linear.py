"""CPU matmuls through oneDNN, with weights prepacked once and epilogues fused.

``F.linear`` on a bf16 CPU tensor hands the weight to oneDNN, which re-lays it out into its
blocked format on every call: for decode-sized batches that costs as much as the matmul.
Packing once at load time makes those matmuls 1.5-2x faster (bit-identical results). oneDNN
also applies SiLU, the SwiGLU product and the residual add in the matmul's epilogue, which
saves whole passes over the activations (in fp32, rounded once: within bf16 rounding of the
unfused ops).

fp32 weights are packed too: ``F.linear`` in fp32 goes to MKL's sgemm, which reads the
weights at ~20 GB/s for 8-row (decode) batches where oneDNN's packed kernels reach 2-4x that
(measured on a 2-core Zen 4: an 8-row decode step's matmuls 11.3 ms -> ~4 ms). The sums are
then accumulated in another order: fp32 results differ from ``F.linear`` by fp32 rounding
(~1e-6 relative), not bit for bit; greedy tokens stay those of transformers.

oneDNN builds (JIT-compiles) a kernel for every new row count and caches it: 3.5-5 ms each on
a Xeon with AMX, where a 547-row bf16 product itself takes 0.4 ms. Prefill chunks and MoE
experts see a new row count almost every step, so the scheduler sizes a large step (over 256
tokens) to one of a few row counts (`trimmed_rows`: at most 8 per power of two), and rows that
still miss them (an MoE expert's share, a small step) are padded up to the next
(`padded_rows`, at most 1/8 extra work) and the result sliced.
"""

from __future__ import annotations

import torch

_linear = torch.ops.mkldnn._linear_pointwise


def packing_helps(weight: torch.Tensor) -> bool:
    """Pack fp32 CPU weights, and bf16 ones where oneDNN has bf16 kernels."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` weight -> an opaque oneDNN tensor for the functions below."""
    packed: torch.Tensor = torch.ops.mkldnn._reorder_linear_weight(
        weight.detach().contiguous(), None
    )
    return packed


def _row_step(rows: int) -> int:
    """The spacing of the row counts kernels are built for near ``rows``: 8 per power of two
    above 32 (1 at and below 32, every count)."""
    return 1 if rows <= 32 else 1 << (rows.bit_length() - 4)


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to one of 8 sizes per power of two (32 and fewer kept as they are)."""
    step = _row_step(rows)
    return -(-rows // step) * step


def trimmed_rows(rows: int) -> int:
    """The largest of those sizes not above ``rows``: the scheduler sizes prefill steps to it."""
    step = _row_step(rows)
    return rows // step * step


def pad(x: torch.Tensor) -> torch.Tensor:
    """``x`` with zero rows appended up to `padded_rows` (``x`` itself when on a size). A
    chain of the functions below is cheaper on a padded input, sliced once at its end: each
    of them pads and slices on its own otherwise."""
    return _pad(x, padded_rows(x.shape[0]))


def _pad(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    out = x.new_empty(rows, x.shape[1])
    out[: x.shape[0]] = x
    out[x.shape[0] :].zero_()
    return out


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    rows = padded_rows(x.shape[0])
    out: torch.Tensor = _linear(_pad(x, rows), packed, bias, "none", [], "")
    return out[: x.shape[0]]


def linear_silu(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """``silu(x @ W.T)``."""
    rows = padded_rows(x.shape[0])
    out: torch.Tensor = _linear(_pad(x, rows), packed, None, "swish", [], "")
    return out[: x.shape[0]]


def linear_mul(x: torch.Tensor, packed: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``(x @ W.T) * other``."""
    rows = padded_rows(x.shape[0])
    out: torch.Tensor = _linear.binary(_pad(x, rows), _pad(other, rows), packed, None, "mul")
    return out[: x.shape[0]]


def linear_add(x: torch.Tensor, packed: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``(x @ W.T) + other``."""
    rows = padded_rows(x.shape[0])
    out: torch.Tensor = _linear.binary(_pad(x, rows), _pad(other, rows), packed, None, "add")
    return out[: x.shape[0]]
