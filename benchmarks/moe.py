"""Engine vs transformers generate() on a mixture-of-experts model, in one process and one run.

    python benchmarks/moe.py [--threads 2] [--repeat 3] [--prompts 8] [--prompt-len 512]

The model is the "bench-moe" tiny-model preset: a Mixtral-shaped checkpoint of ~49M
parameters (8 experts, top-2, 4 layers, random weights, bf16), built once into the kvgate
cache directory. Prints output tokens/s of each at batch 8 (8 prompts x 512 tokens -> exactly
128 new tokens each, greedy) and their ratio, measured as `benchmarks/engine.py` measures the
dense model: alternating rounds, fresh prompts each round, the best round reported with the
process CPU seconds beside it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

# Run as a script, this file's directory comes first on sys.path and benchmarks/engine.py
# would shadow the `engine` package: put the repository root there instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from benchmarks.engine import Transformers, best, engine_run, random_prompts, timed  # noqa: E402
from engine import LLM  # noqa: E402
from engine.tiny_model import CACHE_ENV, make_tiny_model  # noqa: E402

PRESET = "bench-moe"


def bench_model_dir() -> Path:
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvgate")
    path = cache / f"{PRESET}-v1"
    if not (path / "model.safetensors").is_file():
        make_tiny_model(path, seed=0, preset=PRESET)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = bench_model_dir()
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory="512MiB")
    config = llm.core.model_config
    engine_run(llm, random_prompts(2, 32, config.vocab_size, seed=98), 4)  # warm up
    hf = Transformers(path, args.new)
    params = sum(p.numel() for p in hf.model.parameters())
    print(
        f"model {path.name} ({config.architecture}, {params / 1e6:.1f}M parameters, "
        f"{config.num_experts} experts top-{config.num_experts_per_tok}), bf16, "
        f"{args.threads} threads, best of {args.repeat} rounds"
    )
    ours, theirs = [], []
    for round_ in range(args.repeat):
        prompts = random_prompts(args.prompts, args.prompt_len, config.vocab_size, seed=round_)
        ours.append(timed(lambda p=prompts: engine_run(llm, p, args.new)))
        theirs.append(timed(lambda p=prompts: hf.run(p)))
    tokens = args.prompts * args.new
    e, t = best(ours), best(theirs)
    print(f"{args.prompts} prompts x {args.prompt_len} tokens -> {args.new} new tokens each")
    print(f"  engine        {tokens / e.wall:8.1f} output tok/s  ({e.cpu:.1f} CPU s)")
    print(f"  transformers  {tokens / t.wall:8.1f} output tok/s  ({t.cpu:.1f} CPU s)")
    print(f"  ratio         {t.wall / e.wall:8.2f}x  (by CPU time {t.cpu / e.cpu:.2f}x)")


if __name__ == "__main__":
    main()
