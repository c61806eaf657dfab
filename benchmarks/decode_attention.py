"""A decode step's attention: the native kernel's cache read rate against the machine's.

A decode step's attention reads every cached K and V row of every sequence once, so its
floor is those bytes at the machine's read rate. The shape is the bench55m model's (8 layers,
8 query heads, 4 KV heads, head size 64: a step's cache far larger than the CPU's caches) at
batch ``--batch`` (default 8) with ``--keys`` (default 640: a 512-token prompt 128 tokens in)
cached keys each, in shuffled 16-token blocks, for each cache dtype the kernel takes. The
torch path runs interleaved with the kernel, best of ``--rounds`` steps (all layers).

    python benchmarks/decode_attention.py [--batch 8] [--keys 640] [--rounds 20] [--threads N]

``KVGATE_CPU_ISA=avx2`` times the kernel's AVX2 build.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Run as a script, this file's directory comes first on sys.path and benchmarks/engine.py
# would shadow the `engine` package: put the repository root there instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from benchmarks.machine import describe_cpu, memory_gbps  # noqa: E402
from kvgate.engine.attention import AttentionMetadata, allocate_kv_caches, paged_attention  # noqa: E402
from kvgate.engine.attention.cpu import native_decode  # noqa: E402
from kvgate.engine.attention.kv_cache import KVCache  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 8, 4, 64, 8, 16
FP8 = "fp8"


def _step(batch: int, keys: int, dtype: torch.dtype, cache_dtype: str) -> tuple[
    torch.Tensor, list[KVCache], AttentionMetadata
]:  # fmt: skip
    """``batch`` sequences of ``keys`` cached keys each in every layer, one new query each,
    blocks shuffled."""
    per_seq = -(-keys // BLOCK)
    blocks = torch.randperm(batch * per_seq).add(1).tolist()
    tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    stored = torch.float8_e4m3fn if cache_dtype == FP8 else dtype
    caches = allocate_kv_caches(LAYERS, len(blocks) + 1, KV_HEADS, BLOCK, HEAD_DIM, stored, "cpu")
    for cache in caches:
        for data in (cache.k, cache.v):
            data.copy_(torch.randn(data.shape).clamp(-4, 4).to(stored))
        if cache.is_fp8:
            cache.k_scale.uniform_(0.5, 1.5)
            cache.v_scale.uniform_(0.5, 1.5)
    md = AttentionMetadata.from_lists([keys] * batch, [1] * batch, tables, BLOCK)
    q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)
    return q, caches, md


def _cache_bytes(cache: KVCache, batch: int, keys: int) -> int:
    """K and V bytes one layer reads (fp8: with the per-token scales)."""
    per_entry = cache.k.element_size() * HEAD_DIM + (4 if cache.is_fp8 else 0)
    return 2 * batch * keys * KV_HEADS * per_entry


def _all_layers(
    q: torch.Tensor, caches: list[KVCache], md: AttentionMetadata, **kernel: object
) -> None:
    for cache in caches:
        paged_attention(q, cache, md, HEAD_DIM**-0.5, **kernel)  # type: ignore[arg-type]


def _best_ms(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--keys", type=int, default=640)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = native_decode()
    if kernel is None:
        raise SystemExit("the native decode kernel did not build on this machine")
    gbps = memory_gbps()
    print(f"{describe_cpu()}; threads {args.threads}; read rate {gbps:.1f} GB/s")
    cases = [("fp32", torch.float32, "fp32"), ("bf16", torch.bfloat16, "bf16")]
    cases += [("fp8 (fp32 q)", torch.float32, FP8), ("fp8 (bf16 q)", torch.bfloat16, FP8)]
    for name, dtype, cache_dtype in cases:
        q, caches, md = _step(args.batch, args.keys, dtype, cache_dtype)
        reference = functools.partial(_all_layers, q, caches, md)
        native = functools.partial(_all_layers, q, caches, md, decode_kernel=kernel)
        scale = HEAD_DIM**-0.5
        exact = paged_attention(q, caches[0], md, scale).float()
        error = (paged_attention(q, caches[0], md, scale, decode_kernel=kernel) - exact).abs().max()
        torch_ms = native_ms = float("inf")
        for _ in range(3):  # interleaved: the same load for both
            torch_ms = min(torch_ms, _best_ms(reference, args.rounds // 3 + 1))
            native_ms = min(native_ms, _best_ms(native, args.rounds // 3 + 1))
        rate = LAYERS * _cache_bytes(caches[0], args.batch, args.keys) / native_ms / 1e6
        print(
            f"{name:13s} torch {torch_ms:6.3f} ms  native {native_ms:6.3f} ms "
            f"({torch_ms / native_ms:5.2f}x)  reads {rate:5.1f} GB/s = "
            f"{100 * rate / gbps:3.0f}% of the read rate  max |diff| {error.item():.1e}"
        )


if __name__ == "__main__":
    main()
