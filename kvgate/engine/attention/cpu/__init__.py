"""The native CPU attention kernels (``kvgate/engine/csrc/kernels/paged_*.cpp``, in the library
`kvgate.engine.native` loads) as the torch backend's decode and prefill kernels.

`paged_prefill.cpp` is a fused, flash-style prefill attention over the paged cache: tiles of
queries against 16-key panels, an online softmax, no score matrix in memory.

`paged_decode.cpp` reads K/V where they lie in the paged cache, bf16, fp32 or fp8 (no gather
into a padded tensor, each byte read once, fp32 softmax): decode attention 1.6-5x faster than the torch
reference's gather + two batched matmuls on a 2-core Zen 4. Where the library is not to be
had, `native_decode` and `native_prefill` return None and the torch path serves.
"""

from __future__ import annotations

import torch

import kvgate.engine.native as native
from kvgate.engine.attention.kv_cache import FP8_DTYPE, KVCache
from kvgate.engine.attention.metadata import AttentionMetadata


class _NativeKernel:
    """What the decode and prefill kernels share: the head sizes built, and what they take."""

    def __init__(self, head_dims: list[int]):
        self._head_dims = frozenset(head_dims)
        self._no_scales = torch.empty(0)

    def takes(self, q: torch.Tensor, cache: KVCache) -> bool:
        """bf16 or fp32 queries over a cache of the same dtype or of fp8, of a built head size."""
        return (
            q.device.type == "cpu"
            and q.dtype in (torch.bfloat16, torch.float32)
            and cache.k.dtype in (q.dtype, FP8_DTYPE)
            and q.shape[-1] in self._head_dims
        )


class NativeDecode(_NativeKernel):
    """`paged_decode` as the torch backend's decode kernel (`torch_backend.DecodeKernel`)."""

    def __init__(self, ops: native.Library):
        super().__init__(ops.decode_head_dims())
        self._decode = ops.paged_decode

    def __call__(
        self, q: torch.Tensor, cache: KVCache, block_tables: torch.Tensor,
        seq_lens: torch.Tensor, scale: float, window: int | None, softcap: float | None,
    ) -> torch.Tensor:  # fmt: skip
        k_scale, v_scale = (
            (cache.k_scale, cache.v_scale) if cache.is_fp8 else (self._no_scales, self._no_scales)
        )
        out: torch.Tensor = self._decode(
            q.contiguous(), cache.k, cache.v, k_scale, v_scale, block_tables, seq_lens, scale,
            window or 0, softcap or 0.0,
        )  # fmt: skip
        return out


def native_decode() -> NativeDecode | None:
    """The decode kernel for this machine, or None (see `kvgate.engine.native.library`)."""
    ops = native.library()
    return None if ops is None else NativeDecode(ops)


class NativePrefill(_NativeKernel):
    """`paged_prefill` as the torch backend's prefill kernel (`torch_backend.PrefillKernel`)."""

    def __init__(self, ops: native.Library):
        super().__init__(ops.prefill_head_dims())
        self._prefill = ops.paged_prefill
        self.bf16_dot: bool = ops.prefill_bf16_dot()

    def __call__(
        self, q: torch.Tensor, cache: KVCache, md: AttentionMetadata, seqs: torch.Tensor,
        scale: float, window: int | None, softcap: float | None, out: torch.Tensor,
    ) -> None:  # fmt: skip
        """Writes the query rows of the sequences ``seqs`` ([S] int32 indices into ``md``)
        of ``out`` (``[T, Hq, D]``, q's dtype, contiguous)."""
        k_scale, v_scale = (
            (cache.k_scale, cache.v_scale) if cache.is_fp8 else (self._no_scales, self._no_scales)
        )
        self._prefill(
            q.contiguous(), cache.k, cache.v, k_scale, v_scale, md.block_tables, md.seq_lens,
            md.query_start_loc, seqs, scale, window or 0, softcap or 0.0, out,
        )  # fmt: skip


def native_prefill() -> NativePrefill | None:
    """The prefill kernel for this machine, or None (see `kvgate.engine.native.library`)."""
    ops = native.library()
    return None if ops is None else NativePrefill(ops)
