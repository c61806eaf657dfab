"""Engine vs transformers generate() on a mixture-of-experts model, in one process and one run.

    python benchmarks/moe.py [--dtype auto] [--threads 2] [--repeat 3] [--prompts 8] [--prompt-len 512]

The model is the "bench-moe" tiny-model preset: a Mixtral-shaped checkpoint of ~49M
parameters (8 experts, top-2, 4 layers, random weights), built once into the kvgate cache
directory. Prints output tokens/s of each at batch 8 in the CPU's native dtype (8 prompts x
512 tokens -> exactly 128 new tokens each, greedy) and their ratio, measured as
`benchmarks/engine.py` measures the dense model: alternating rounds, fresh prompts each
round, the best round reported.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# Run as a script, this file's directory comes first on sys.path and benchmarks/engine.py
# would shadow the `engine` package: put the repository root there instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from benchmarks.engine import Bench, kvgate_runner, transformers_runner  # noqa: E402
from kvgate.engine import LLM  # noqa: E402
from kvgate.engine.config import cache_dir, choose_dtype  # noqa: E402
from kvgate.engine.loading.tiny_model import make_tiny_model  # noqa: E402
from kvgate.engine.models.model_config import ModelConfig  # noqa: E402

PRESET = "bench-moe"


def bench_model_dir() -> Path:
    cache = cache_dir()
    path = cache / f"{PRESET}-v1"
    if not (path / "model.safetensors").is_file():
        make_tiny_model(path, seed=0, preset=PRESET)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    choice = choose_dtype(args.dtype, "cpu")
    path = bench_model_dir()
    config = ModelConfig.from_dir(path)
    llm = LLM(str(path), dtype=choice.name, kv_cache_memory="1GiB", threads=args.threads)
    engines = {
        "kvgate": kvgate_runner(llm),
        "transformers": transformers_runner(path, choice.name),
    }
    print(
        f"model {path.name} ({config.architecture}, {config.num_experts} experts "
        f"top-{config.num_experts_per_tok}), {choice.name} ({choice.reason}), "
        f"{args.threads} threads, best of {args.repeat} alternating rounds"
    )
    times = Bench(engines, args.repeat, config.vocab_size, llm).best(
        0, args.prompts, args.prompt_len, args.new
    )
    tokens = args.prompts * args.new
    print(f"{args.prompts} prompts x {args.prompt_len} tokens -> {args.new} new tokens each")
    for name, wall in times.items():
        print(f"  {name:13s} {tokens / wall:8.1f} output tok/s")
    print(f"  ratio         {times['transformers'] / times['kvgate']:8.2f}x")


if __name__ == "__main__":
    main()
