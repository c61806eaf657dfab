"""Matmuls on GGUF-quantized weights (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) kept
quantized.

A decode step on CPU reads every weight once per token: bandwidth-bound, so a weight read as
4.5-8.5 bits instead of bf16's 16 costs 2-3.5x fewer bytes, and the model holds that much less
memory. `QuantizedLinear` keeps a ``[out, in]`` weight as the file's own blocks (one row of
blocks per output feature, as llama.cpp lays them out) and computes with
``kvgate/engine/csrc/kernels/qgemm.cpp``: activations quantized to int16 per 32-block once per
call and integer dot products (see the source for the arithmetic). Where the kernels compute
faster on another layout of the same blocks (`layout`: Q4_0/Q4_1/Q8_0 rows interleaved 8 by 8
with AVX2 or AVX-512), the blocks are laid out so once, at load. The output is in the
activations' dtype, rounded once after the fused epilogue (SwiGLU, a residual add).

That product costs per row: it wins where the weight's bytes dominate (decode: 1 to a few
rows), and loses to a dense bf16 GEMM on prefill-sized batches. From `DENSE_ROWS` rows on, the
weight is dequantized for the call into a scratch tensor and multiplied densely (its cost then
shared by the rows). The threshold is measured (see `DENSE_ROWS`).

Where the native library is not to be had (``KVGATE_CPU_KERNELS=0``, not installed), the GGUF
loader dequantizes at load instead.
"""

from __future__ import annotations

import copy
import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvgate.engine.native import Library

# ggml type id -> (weights per block, bytes per block): the K-quants' blocks are super-blocks
# of 256 (Q4_K_M files hold Q4_K and Q6_K tensors, Q5_K_M files Q5_K and Q6_K; where a
# model's rows are not whole super-blocks, llama.cpp writes Q5_0, Q5_1 or Q8_0 instead).
BLOCKS = {
    8: (32, 34),
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    7: (32, 24),
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
}
TYPE_NAMES = {
    8: "Q8_0",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
}
DENSE_ROWS = 64


class QuantizedLinear:
    """A ``[out_features, in_features]`` weight as GGUF blocks (``uint8 [out, in/32 * bytes]``)
    of ggml type `qtype`, and the products the model takes of it."""

    def __init__(self, blocks: torch.Tensor, qtype: int, in_features: int, ops: Library):
        if qtype not in BLOCKS:
            raise ValueError(f"ggml type {qtype} is not one the quantized kernels compute")
        values, nbytes = BLOCKS[qtype]
        if in_features % values or blocks.shape[1] != in_features // values * nbytes:
            raise ValueError(
                f"{TYPE_NAMES[qtype]} blocks {list(blocks.shape)} do not hold {in_features} inputs"
            )
        self.qtype = qtype
        self.in_features = in_features
        self.out_features = int(blocks.shape[0])
        # The layout the kernels compute fastest on (`qgemm_layout`): the file's, or 8 rows'
        # blocks interleaved (Q4_0/Q4_1/Q8_0 with AVX2 or AVX-512), whose extra rows cost a
        # fraction as much.
        self.layout = int(ops.qgemm_layout(qtype, self.out_features))
        if self.layout == qtype:
            self.blocks = blocks.contiguous()
        else:
            self.blocks = ops.qgemm_interleave(blocks.contiguous(), qtype, in_features)
        self._kernels = ops

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def stacked(self, below: QuantizedLinear) -> QuantizedLinear:
        """This weight with `below`'s rows under it, one product (both in one layout: a group
        of 8 interleaved rows never straddles the two)."""
        joined = copy.copy(self)
        joined.blocks = torch.cat([self.blocks, below.blocks])
        joined.out_features = self.out_features + below.out_features
        return joined

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, float_out: bool = False
    ) -> torch.Tensor:
        """``x @ W.T (+ bias)`` in ``x``'s dtype (fp32 with ``float_out``: logits)."""
        if x.shape[0] >= DENSE_ROWS:
            y = F.linear(x, self.dense(x.dtype), bias)
            return y.float() if float_out else y
        return self._kernels.qlinear(  # type: ignore[no-any-return]
            x.contiguous(), self.blocks, self.layout, bias, None, float_out
        )

    def linear_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``x @ W.T + residual``."""
        if x.shape[0] >= DENSE_ROWS:
            return torch.addmm(residual, x, self.dense(x.dtype).t())
        return self._kernels.qlinear(  # type: ignore[no-any-return]
            x.contiguous(), self.blocks, self.layout, None, residual, False
        )

    def linear_gated(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """``silu(x @ G.T) * (x @ U.T)`` where the weight is G's rows then U's (SwiGLU only:
        `kvgate.engine.loading.gguf.quantized` serves no other MLP quantized)."""
        if act != "silu":
            raise ValueError(f"quantized gate/up pairs compute SiLU x up, not {act}")
        if x.shape[0] >= DENSE_ROWS:
            gate, up = F.linear(x, self.dense(x.dtype)).chunk(2, dim=-1)
            return F.silu(gate).mul_(up)
        return self._kernels.qlinear_swiglu(  # type: ignore[no-any-return]
            x.contiguous(), self.blocks, self.layout
        )

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight dequantized, ``[out, in]`` in ``dtype`` (bf16 or fp32)."""
        return self._kernels.dequantize(  # type: ignore[no-any-return]
            self.blocks, self.layout, self.in_features, dtype == torch.bfloat16
        )

    def embedding(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` of the dequantized weight (an embedding table's lookup)."""
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"quantized embeddings are looked up in bf16 or fp32, not {dtype}")
        return self._kernels.dequantize_rows(  # type: ignore[no-any-return]
            self.blocks, self.layout, self.in_features, ids, dtype == torch.bfloat16
        )


def concat(parts: list[QuantizedLinear]) -> QuantizedLinear | StackedLinear:
    """The weights one above the other (q/k/v, gate/up): one product for each run of parts of
    one type (all of them where they agree, as mostly; a Q4_K_M file's v is Q6_K beside a
    Q4_K q and k)."""
    first = parts[0]
    if any(p.in_features != first.in_features for p in parts):
        raise ValueError("only weights of one input size are concatenated")
    runs: list[list[QuantizedLinear]] = []
    for part in parts:
        if runs and runs[-1][0].layout == part.layout:
            runs[-1].append(part)
        else:
            runs.append([part])
    joined = [functools.reduce(QuantizedLinear.stacked, run) for run in runs]
    return joined[0] if len(joined) == 1 else StackedLinear(joined)


class StackedLinear:
    """Quantized weights of different types one above the other, as one `LinearWeight`: a
    product per part, the outputs side by side (one extra copy of a few rows: far cheaper than
    serving the whole module dequantized, which reads 2-4x the weight bytes)."""

    def __init__(self, parts: list[QuantizedLinear]):
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def linear(
        self, x: torch.Tensor, bias: torch.Tensor | None = None, float_out: bool = False
    ) -> torch.Tensor:
        y = torch.cat([p.linear(x, None, float_out) for p in self.parts], dim=-1)
        return y if bias is None else y.add_(bias)

    def linear_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.linear(x).add_(residual)

    def linear_gated(self, x: torch.Tensor, act: str) -> torch.Tensor:
        """SiLU(gate) x up over the stacked gate and up rows."""
        if act != "silu":
            raise ValueError(f"quantized gate/up pairs compute SiLU x up, not {act}")
        gate, up = self.linear(x).chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.cat([p.dense(dtype) for p in self.parts])
