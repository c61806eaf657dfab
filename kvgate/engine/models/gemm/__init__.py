"""The model's CPU matmuls through a small-batch GEMM of our own
(``kvgate/engine/csrc/kernels/gemm.cpp``, in the library `kvgate.engine.native` loads).

Decode multiplies a few rows by every weight: the matmuls are memory-bound, and oneDNN's
prepacked kernels read the weights at about half the rate a plain read reaches on a 2-core
Zen 4 (15-16 vs 23-32 GB/s at 1-8 rows). `gemm.cpp` streams weights repacked at load into
its own panels (see there) and fuses the epilogues: bias, the residual add, and SiLU(gate) x
up over one gate/up matrix whose panels alternate (one read of x, one write of the hidden).

`NativeLinear` holds the one copy of a weight in that layout and serves every row count:
the kernel also runs prefills (rows tiled 8 at a time over each panel pair, the pair kept in
L2) within 0.85-1.05x of oneDNN's time from 64 to 1,024 rows on the bench shapes (2-core
Zen 4, `benchmarks/gemm.py`; noisy), so no oneDNN copy is kept beside it: an unpack per
call for oneDNN cost 2-4x at 128 rows. `OneDnnLinear` is the same interface
over `packed_linear` (oneDNN's prepacked copy), where the library is not to be had
(``KVGATE_CPU_KERNELS=0``, not installed). A quantized handle can join them: the model only
calls `linear`, `linear_add` and `linear_gated`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

import kvgate.engine.models.packed_linear as pl
import kvgate.engine.native as native

Activation = Literal["silu", "gelu"]
_MODES = {"silu": 1, "gelu": 2}
_ACT: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": functools.partial(F.gelu, approximate="tanh"),
}


class LinearWeight(Protocol):
    """A matmul weight ``[n, K]`` (or a gate/up pair) in whatever layout its kernels read."""

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T (+ bias)``; for a gate/up pair, ``[gate | up]`` side by side."""
        ...

    def linear_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + x @ W.T``, summed in fp32 and rounded once."""
        ...

    def linear_gated(self, x: torch.Tensor, act: Activation) -> torch.Tensor:
        """A gate/up pair's ``act(x @ G.T) * (x @ U.T)``."""
        ...


def pack_panels(weight: torch.Tensor, width: int, pairs: bool) -> torch.Tensor:
    """``[n, K]`` -> ``[panels, K, width]`` (``[panels, K/2, width, 2]`` as pairs, viewed as
    ``[panels, K/2, 2 * width]``): columns zero-padded to whole panels, K to even for pairs."""
    n, k = weight.shape
    panels = -(-n // width)
    if not pairs:
        padded = F.pad(weight, (0, 0, 0, panels * width - n))
        return padded.view(panels, width, k).transpose(1, 2).contiguous()
    padded = F.pad(weight, (0, k % 2, 0, panels * width - n))
    k2 = (k + 1) // 2
    packed = padded.view(panels, width, k2, 2).permute(0, 2, 1, 3).contiguous()
    return packed.view(panels, k2, 2 * width)


class NativeLinear:
    """One weight in `gemm.cpp`'s layout; a gate/up pair with their panels alternating."""

    def __init__(self, ops: native.Library, weight: torch.Tensor, gated: bool = False):
        width, pairs = ops.gemm_layout()
        self._gemm: Callable[..., torch.Tensor] = ops.gemm
        self.pairs = pairs and weight.dtype == torch.bfloat16
        self.width = width
        n, self.k = weight.shape
        if gated:  # gate rows then up rows in; panels g0 u0 g1 u1 ... out
            self.half = n // 2
            gate, up = (pack_panels(w, width, self.pairs) for w in weight.detach().chunk(2))
            self.packed = torch.stack((gate, up), dim=1).flatten(0, 1)
        else:
            self.half = 0
            self.packed = pack_panels(weight.detach(), width, self.pairs)
        self.n = n

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self._gemm(x.contiguous(), self.packed, self.n, self.half, 0, bias, None)

    def linear_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self._gemm(
            x.contiguous(), self.packed, self.n, self.half, 0, None, residual.contiguous()
        )

    def linear_gated(self, x: torch.Tensor, act: Activation) -> torch.Tensor:
        if not self.half:
            raise ValueError("linear_gated needs a gate/up pair")
        return self._gemm(x.contiguous(), self.packed, self.n, self.half, _MODES[act], None, None)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the weight, ``[len(ids), K]``: a tied lm_head's packed copy serves
        the embedding lookup too, so the table is held once (Llama 3.2 1B: 525 MB less)."""
        if self.half:
            raise ValueError("rows of a gate/up pair are not one weight's")
        panel, column = ids // self.width, ids % self.width
        if self.pairs:  # [panels, K/2, width, 2]: a row is column `column`'s pairs
            panels = self.packed.view(self.packed.shape[0], self.packed.shape[1], self.width, 2)
            return panels[panel, :, column].reshape(ids.shape[0], -1)[:, : self.k].contiguous()
        return self.packed[panel, :, column]


class OneDnnLinear:
    """`packed_linear`'s oneDNN-prepacked weight; a gate/up pair packed apart, so that SiLU
    and the product run in the matmul epilogues."""

    def __init__(self, weight: torch.Tensor, gated: bool = False):
        self.half = weight.shape[0] // 2 if gated else 0
        parts = weight.chunk(2) if gated else (weight,)
        self.packed = [pl.pack(part) for part in parts]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        outs = [pl.linear(x, packed, bias) for packed in self.packed]
        return outs[0] if len(outs) == 1 else torch.cat(outs, -1)

    def linear_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if self.half:
            return residual + self.linear(x)
        return pl.linear_add(x, self.packed[0], residual)

    def linear_gated(self, x: torch.Tensor, act: Activation) -> torch.Tensor:
        if not self.half:
            raise ValueError("linear_gated needs a gate/up pair")
        gate_w, up_w = self.packed
        rows, x = x.shape[0], pl.pad(x)  # padded once for the chain, sliced at its end
        if act == "gelu":
            gate = F.gelu(pl.linear(x, gate_w), approximate="tanh")
        else:
            gate = pl.linear_silu(x, gate_w)
        return pl.linear_mul(x, up_w, gate)[:rows]


class PlainLinear:
    """The plain weight through ``F.linear``: where nothing packs it (GPUs, other dtypes)."""

    def __init__(self, weight: torch.Tensor, gated: bool = False):
        self.weight = weight
        self.half = weight.shape[0] // 2 if gated else 0

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, bias)

    def linear_add(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return residual + F.linear(x, self.weight)

    def linear_gated(self, x: torch.Tensor, act: Activation) -> torch.Tensor:
        if not self.half:
            raise ValueError("linear_gated needs a gate/up pair")
        gate, up = F.linear(x, self.weight).chunk(2, dim=-1)
        return _ACT[act](gate) * up


def packs(weight: torch.Tensor) -> bool:
    """Whether weights like this one are packed: where oneDNN could take them (CPU, fp32, and
    bf16 where it has bf16 kernels), so that its path remains wherever the kernel is not built."""
    return pl.packing_helps(weight)


def pack(weight: torch.Tensor, gated: bool = False) -> LinearWeight:
    """``weight [n, K]`` (gate rows then up rows where ``gated``) as the kernel's one copy, or
    oneDNN's where the library is not to be had, or as it is where nothing packs it."""
    if not packs(weight):
        return PlainLinear(weight, gated)
    ops = native.library()
    if ops is not None:
        return NativeLinear(ops, weight, gated)
    return OneDnnLinear(weight, gated)
