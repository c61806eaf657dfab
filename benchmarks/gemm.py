"""The decode matmuls: `kvgate.engine.models.gemm`'s kernel against oneDNN's prepacked ones, per shape.

    python benchmarks/gemm.py [--dtype bfloat16|float32] [--rows 1,8,32] [--rounds 5]
                              [--models bench55m,smollm2] [--threads N]
                              [--engine [--engine-model bench55m|bench-moe]]

For each weight of a layer of the bench model (bench55m) and of SmolLM2-135M (qkv, o with
the residual add, gate/up with SiLU x up, down with the residual add, lm_head), prints the
time per call and the weight read rate of both at each row count, and the machine's plain
read rate measured in the same run. Each shape is held in enough copies (over 192 MiB) that
calls cycling through them read from memory, as a decode step does, not from the caches.
Rounds alternate the two; each call is timed and the median kept (a neighbour's process
preempting a thread spoils single calls, not the median): still, read the ratios only.

``--engine`` times `LLM.generate` on the bench model instead (``--engine-model bench-moe``:
the MoE one), greedy, 1 x 128 -> 64 and 8 x 128 -> 64 tokens, once with the kernel and once
on oneDNN's packed weights, in turn.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

import kvgate.engine.native as native  # noqa: E402
from benchmarks import moe  # noqa: E402
from benchmarks.engine import bench_model_dir, random_prompts  # noqa: E402
from benchmarks.machine import memory_gbps  # noqa: E402
from kvgate.engine import LLM, SamplingParams  # noqa: E402
from kvgate.engine.models import gemm  # noqa: E402

FOOTPRINT = 192 << 20  # bytes of copies per shape: past any L3 here
# name -> (out, in, kind): kind "gated" (gate and up rows, SiLU x up), "add" (residual).
MODELS = {
    "bench55m": {
        "qkv": (1024, 512, "plain"),
        "o": (512, 512, "add"),
        "gate_up": (6656, 512, "gated"),
        "down": (512, 3328, "add"),
        "lm_head": (8192, 512, "plain"),
    },
    "smollm2": {
        "qkv": (960, 576, "plain"),
        "o": (576, 576, "add"),
        "gate_up": (3072, 576, "gated"),
        "down": (576, 1536, "add"),
        "lm_head": (49152, 576, "plain"),
    },
}


def _call(weight: gemm.LinearWeight, kind: str, x: torch.Tensor, residual: torch.Tensor) -> None:
    if kind == "gated":
        weight.linear_gated(x, "silu")
    elif kind == "add":
        weight.linear_add(x, residual)
    else:
        weight.linear(x)


def engine_ratio(dtype: str, rounds: int, model: str) -> None:
    """Output tok/s of the engine on a bench model with the kernel and on oneDNN."""
    path = moe.bench_model_dir() if model == "bench-moe" else bench_model_dir()
    kernel = LLM(str(path), dtype=dtype, kv_cache_memory="256MiB")
    with mock.patch.object(gemm, "load", lambda: None):  # packed for oneDNN, as without a build
        onednn = LLM(str(path), dtype=dtype, kv_cache_memory="256MiB")
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    for seqs in (1, 8):
        best = {"kernel": 0.0, "oneDNN": 0.0}
        for round_ in range(rounds):
            prompts = random_prompts(seqs, 128, 8000, seed=round_)
            for name, llm in (("kernel", kernel), ("oneDNN", onednn)):
                start = time.perf_counter()
                llm.generate(prompts, params)
                best[name] = max(best[name], seqs * 64 / (time.perf_counter() - start))
        print(
            f"{seqs} x 128 -> 64: kernel {best['kernel']:.0f} tok/s, oneDNN {best['oneDNN']:.0f}"
            f" tok/s ({best['kernel'] / best['oneDNN']:.2f}x)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rows", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--engine", action="store_true", help="LLM.generate, both ways")
    parser.add_argument("--engine-model", default="bench55m", choices=["bench55m", "bench-moe"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.engine:
        engine_ratio(args.dtype, args.rounds, args.engine_model)
        return
    dtype = getattr(torch, args.dtype)
    ops = native.library()
    if ops is None:
        raise SystemExit("no native library (KVGATE_CPU_KERNELS=0? not installed?)")
    print(f"threads {torch.get_num_threads()}, {args.dtype}, plain read {memory_gbps():.1f} GB/s")
    rows_list = [int(r) for r in args.rows.split(",")]
    print(f"{'shape':18} {'rows':>4} {'kernel us':>10} {'GB/s':>6} {'oneDNN us':>10} {'GB/s':>6}")
    for model in args.models.split(","):
        for name, (out, inp, kind) in MODELS[model].items():
            size = out * inp * dtype.itemsize
            copies = max(2, FOOTPRINT // size)
            weights = [torch.randn(out, inp).div_(inp**0.5).to(dtype) for _ in range(copies)]
            ours: list[gemm.LinearWeight] = [
                gemm.NativeLinear(ops, w, kind == "gated") for w in weights
            ]
            theirs: list[gemm.LinearWeight] = [
                gemm.OneDnnLinear(w, kind == "gated") for w in weights
            ]
            del weights
            for rows in rows_list:
                x = torch.randn(rows, inp).to(dtype)
                residual = torch.randn(rows, out).to(dtype)
                calls: list[list[float]] = [[], []]
                for _ in range(args.rounds):
                    for i, handles in enumerate((ours, theirs)):
                        for w in handles:
                            start = time.perf_counter()
                            _call(w, kind, x, residual)
                            calls[i].append(time.perf_counter() - start)
                best = [statistics.median(times) for times in calls]
                us = [b * 1e6 for b in best]
                rates = [size / b / 1e9 for b in best]
                print(
                    f"{model + ' ' + name:18} {rows:>4} {us[0]:>10.1f} {rates[0]:>6.1f}"
                    f" {us[1]:>10.1f} {rates[1]:>6.1f}"
                )
            del ours, theirs
    print(f"plain read at the end {memory_gbps():.1f} GB/s")


if __name__ == "__main__":
    main()
