"""One layer's prefill attention: the native fused kernel against the torch path it replaces.

The shape is the bench55m model's (`kvgate.engine.loading.tiny_model` preset: 8 query heads, 4 KV heads,
head size 64, 8 layers) in bf16, a ``--tokens``-token prompt (default 2,000) in 16-token
blocks; the kernel also runs the fp32 path and a chunk after a cached prefix. The two paths
run interleaved, best of ``--rounds``, in one process, so their ratio holds on a shared
machine even where the absolute times do not.

    python benchmarks/prefill_attention.py [--tokens 2000] [--rounds 5] [--threads N]

``KVGATE_CPU_ISA=avx2`` times the kernel's AVX2 build (the torch path is unchanged by it).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Run as a script, this file's directory comes first on sys.path and benchmarks/engine.py
# would shadow the `engine` package: put the repository root there instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from kvgate.engine.attention import AttentionMetadata, allocate_kv_caches, paged_attention  # noqa: E402
from kvgate.engine.attention.cpu import native_prefill  # noqa: E402
from kvgate.engine.attention.kv_cache import KVCache  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 8, 4, 64, 8, 16


def _step(
    tokens: int, queries: int, dtype: torch.dtype
) -> tuple[torch.Tensor, KVCache, AttentionMetadata]:
    """One sequence's ``queries`` last positions of a ``tokens``-long context, in shuffled blocks."""
    blocks = -(-tokens // BLOCK)
    (cache,) = allocate_kv_caches(1, blocks + 1, KV_HEADS, BLOCK, HEAD_DIM, dtype, "cpu")
    cache.k.copy_(torch.randn(cache.k.shape))
    cache.v.copy_(torch.randn(cache.v.shape))
    table = torch.randperm(blocks).add(1).tolist()
    md = AttentionMetadata.from_lists([tokens], [queries], [table], BLOCK)
    q = torch.randn(queries, HEADS, HEAD_DIM).to(dtype)
    return q, cache, md


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = native_prefill()
    if kernel is None:
        raise SystemExit("the native prefill kernel did not build on this machine")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"threads {args.threads}, load {load}, bf16 dot {kernel.bf16_dot}")
    scale = HEAD_DIM**-0.5
    cases = [
        ("bf16 prompt", args.tokens, args.tokens, torch.bfloat16),
        ("fp32 prompt", args.tokens, args.tokens, torch.float32),
        ("bf16 chunk of 256 after the rest", args.tokens, 256, torch.bfloat16),
    ]
    for name, tokens, queries, dtype in cases:
        q, cache, md = _step(tokens, queries, dtype)
        reference = functools.partial(paged_attention, q, cache, md, scale)
        fused = functools.partial(paged_attention, q, cache, md, scale, prefill_kernel=kernel)
        reference(), fused()  # warm up
        torch_times, native_times = [], []
        for _ in range(args.rounds):  # interleaved: the same load for both
            torch_times.append(_seconds(reference))
            native_times.append(_seconds(fused))
        error = (fused().float() - reference().float()).abs().max().item()
        t, n = min(torch_times) * 1e3, min(native_times) * 1e3
        print(
            f"{name:34s} torch {t:7.2f} ms  native {n:7.2f} ms  ({t / n:.2f}x)  "
            f"x{LAYERS} layers: {t * LAYERS:6.0f} -> {n * LAYERS:5.0f} ms  max |diff| {error:.1e}"
        )


if __name__ == "__main__":
    main()
