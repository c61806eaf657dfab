"""What the machine can do, measured, and what a workload can therefore take at best.

The roofline of a generation workload: the prefill is compute-bound (its FLOPs at the
measured matmul rate), each later decode step takes the longer of its FLOPs at that rate and
its bytes (every matmul weight plus the KV it attends over) at the measured read bandwidth.
An engine's share of that time is how close it runs to the hardware.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.record import cpu_model
from kvgate.engine.config import cpu_flags, native_bf16_flags, usable_cores
from kvgate.engine.models import packed_linear as pl
from kvgate.engine.models.model_config import ModelConfig

# Flags worth naming: what the matmul and attention kernels can use.
SHOWN_FLAGS = (
    "avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
    "amx_bf16", "amx_int8", "sve", "bf16",
)  # fmt: skip


def describe_cpu() -> str:
    flags = [f for f in SHOWN_FLAGS if f in cpu_flags()]
    native = "native bf16" if native_bf16_flags() else "no native bf16"
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"CPU {cpu_model()}, {usable_cores()} usable cores; flags: {' '.join(flags) or 'none'} "
        f"({native}); load average {load}"
    )


def _best_seconds(fn: Callable[[], object], rounds: int = 10) -> float:
    """The fastest of ``rounds`` calls: on a shared machine the others are the neighbours'."""
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_gflops(dtype: torch.dtype, k: int, n: int, m: int = 2048) -> float:
    """The best rate of an ``[m, k] x [k, n]`` matmul in ``dtype``, by the fastest path the
    engine could take (``F.linear``, or prepacked oneDNN where it is available)."""
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    seconds = _best_seconds(lambda: F.linear(x, w))
    if pl.packing_helps(w):
        packed = pl.pack(w)
        seconds = min(seconds, _best_seconds(lambda: pl.linear(x, packed)))
    return 2 * m * k * n / seconds / 1e9


def memory_gbps(size_bytes: int = 512 << 20) -> float:
    """Read bandwidth: a reduction over a buffer far larger than the caches."""
    buffer = torch.ones(size_bytes // 4, dtype=torch.float32)
    return size_bytes / _best_seconds(lambda: buffer.sum()) / 1e9


@dataclass(frozen=True)
class Machine:
    gflops: float
    gbps: float


@dataclass(frozen=True)
class ModelCost:
    """FLOPs and bytes of one model in one dtype, per token and per context token."""

    layer_params: int  # matmul weights of all decoder layers
    output_only_params: int  # the last layer's past its K/V projections: for sampled rows only
    layers: int
    head_params: int  # lm_head (vocab x hidden)
    weight_bytes: int  # read once per decode step
    attn_flops_per_pair: int  # one query attending to one key, all layers and heads
    kv_bytes_per_token: int  # all layers, K and V

    @classmethod
    def of(cls, c: ModelConfig, dtype_bytes: int, kv_dtype_bytes: int) -> ModelCost:
        per_layer = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
        per_layer += 3 * c.hidden_size * c.intermediate_size
        layer_params, head = c.num_layers * per_layer, c.vocab_size * c.hidden_size
        return cls(
            layer_params=layer_params,
            output_only_params=per_layer - 2 * c.hidden_size * c.kv_size,
            layers=c.num_layers,
            head_params=head,
            weight_bytes=(layer_params + head) * dtype_bytes,
            attn_flops_per_pair=4 * c.num_layers * c.num_heads * c.head_dim,
            kv_bytes_per_token=2 * c.num_layers * c.num_kv_heads * c.head_dim * kv_dtype_bytes,
        )

    def prefill_seconds(self, machine: Machine, seqs: int, prompt: int) -> float:
        """Every layer for every prompt row but the last layer past its K/V write, which only
        each prompt's last row (the one sampled) needs."""
        flops = 2 * seqs * prompt * self.layer_params + 2 * seqs * self.head_params
        flops -= 2 * seqs * (prompt - 1) * self.output_only_params
        pairs = seqs * prompt * (prompt + 1) // 2
        per_layer = self.attn_flops_per_pair // self.layers
        flops += per_layer * ((self.layers - 1) * pairs + seqs * prompt)
        return flops / (machine.gflops * 1e9)

    def decode_step_seconds(self, machine: Machine, seqs: int, context: int) -> float:
        flops = 2 * seqs * (self.layer_params + self.head_params)
        flops += self.attn_flops_per_pair * seqs * context
        read = self.weight_bytes + self.kv_bytes_per_token * seqs * context
        return max(flops / (machine.gflops * 1e9), read / (machine.gbps * 1e9))

    def generation_seconds(self, machine: Machine, seqs: int, prompt: int, new: int) -> float:
        """Prefill (which yields the first token), then ``new - 1`` decode steps."""
        steps = sum(self.decode_step_seconds(machine, seqs, prompt + i) for i in range(1, new))
        return self.prefill_seconds(machine, seqs, prompt) + steps
