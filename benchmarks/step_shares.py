"""Where an offline `LLM`'s time goes: matmuls (GEMM), attention, and the rest.

The matmul weight handles' methods (`kvgate.engine.models.gemm`) and each replica's
attention backend are wrapped, for the length of one run, by timers that add up their wall
time and the weight bytes each matmul reads (attention includes the KV cache writes). What is left of the run's wall time is "the
rest": norms, rotary embedding, sampling, scheduling, Python. The timers cost ~0.2 µs a
call (a few hundred calls a step), so the shares are those of an unprofiled run to within
about 1%; the GEMM's GB/s is the weight bytes over its time, held against the machine's
measured read rate.

The decode stack (`kvgate.engine.models.decode_stack`) calls the same kernels from C++, where these
timers cannot see them, so it is off for the measured block: a decode's shares are those of
the Python layers, whose "rest" is what the stack takes away (compare the timed runs).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kvgate.engine import LLM
from kvgate.engine.models import gemm
from kvgate.engine.models.quantized_linear import QuantizedLinear

# The matmul weight handles the models call, and their methods.
HANDLES: list[type] = [gemm.NativeLinear, gemm.OneDnnLinear, gemm.PlainLinear, QuantizedLinear]
METHODS = ("linear", "linear_add", "linear_gated")


@dataclass
class StepShares:
    wall_s: float = 0.0
    gemm_s: float = 0.0
    attention_s: float = 0.0
    gemm_bytes: int = 0
    calls: dict[str, int] = field(default_factory=dict)
    depth: int = 0

    @property
    def rest_s(self) -> float:
        return max(0.0, self.wall_s - self.gemm_s - self.attention_s)

    def describe(self, read_gbps: float) -> str:
        gbps = self.gemm_bytes / self.gemm_s / 1e9 if self.gemm_s else 0.0
        return (
            f"GEMM {100 * self.gemm_s / self.wall_s:4.1f}%  attention "
            f"{100 * self.attention_s / self.wall_s:4.1f}%  rest {100 * self.rest_s / self.wall_s:4.1f}%"
            f"  (of {self.wall_s * 1000:.0f} ms); GEMM reads weights at {gbps:.1f} GB/s "
            f"= {100 * gbps / read_gbps:.0f}% of the measured {read_gbps:.1f} GB/s"
        )


def weight_bytes(handle: Any) -> int:
    """The bytes a matmul reads of its weight handle: every tensor it holds."""
    tensors: list[torch.Tensor] = []
    for value in vars(handle).values():
        items = value if isinstance(value, list | tuple) else [value]
        tensors += [item for item in items if isinstance(item, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def _timed(fn: Callable[..., Any], shares: StepShares, kind: str) -> Callable[..., Any]:
    """``fn`` timed into ``shares``; a call made inside another timed one (a handle whose
    method calls its own ``linear``) is the outer one's time, not counted twice."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if shares.depth:
            return fn(*args, **kwargs)
        shares.depth += 1
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.perf_counter() - start
            shares.depth -= 1
            if kind == "gemm":
                shares.gemm_s += spent
                shares.gemm_bytes += weight_bytes(args[0])
            else:
                shares.attention_s += spent
            shares.calls[kind] = shares.calls.get(kind, 0) + 1

    return wrapper


@contextmanager
def measured(llm: LLM) -> Iterator[StepShares]:
    """Times every matmul and attention call ``llm`` makes inside the block; the block's wall
    time is the denominator. One replica steps at a time in an offline `LLM` (its caller's
    thread), so the timers never overlap."""
    shares = StepShares()
    originals = {
        (cls, name): getattr(cls, name) for cls in HANDLES for name in METHODS if hasattr(cls, name)
    }
    runners = [replica.runner for replica in llm.core.replicas]
    backends = [runner.backend for runner in runners]
    for (cls, name), fn in originals.items():
        setattr(cls, name, _timed(fn, shares, "gemm"))
    for runner, backend in zip(runners, backends, strict=True):
        runner.backend = replace(
            backend,
            write_kv=_timed(backend.write_kv, shares, "attention"),
            paged_attention=_timed(backend.paged_attention, shares, "attention"),
            decode_kernel=None,  # no decode stack: its kernel calls would go untimed
        )
    start = time.perf_counter()
    try:
        yield shares
    finally:
        shares.wall_s = time.perf_counter() - start
        for (cls, name), fn in originals.items():
            setattr(cls, name, fn)
        for runner, backend in zip(runners, backends, strict=True):
            runner.backend = backend
