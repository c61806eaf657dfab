"""The cost of batched LoRA: output tok/s of a batch mixing the base model and two adapters,
against the same batch on the base model alone, in one run.

    python benchmarks/lora.py [--dtype auto|float32|bfloat16] [--threads N] [--repeat 3]
                              [--rank 16] [--batch 8] [--prompt 128] [--new 64]

The model is the "bench55m" tiny-model preset (built once into the kvgate cache directory);
the two adapters are random rank-``--rank`` PEFT folders targeting all seven projections (the
most work an adapter can add), written next to it. Each round runs both batches on the same
engine, in turn, on fresh prompts (no prefix hits); the best round of each is reported, with
their ratio. Run it on an otherwise idle machine (``flock`` with other benchmarks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not this folder

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from benchmarks.engine import bench_model_dir, random_prompts  # noqa: E402
from benchmarks.machine import describe_cpu  # noqa: E402
from kvgate.engine import LLM, SamplingParams  # noqa: E402
from kvgate.engine.models.lora import CONFIG_FILE, WEIGHTS_FILE, LoRARequest, site_shapes  # noqa: E402
from kvgate.engine.models.model_config import ModelConfig  # noqa: E402


def write_adapter(model: Path, out: Path, rank: int, seed: int) -> Path:
    """A random PEFT adapter on every projection of ``model``'s layers."""
    config = ModelConfig.from_dir(model)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target, (size_in, size_out) in site_shapes(config, layer).items():
            kind = "mlp" if target in ("gate", "up", "down") else "self_attn"
            name = f"base_model.model.model.layers.{layer}.{kind}.{target}_proj"
            tensors[f"{name}.lora_A.weight"] = (
                torch.randn(rank, size_in, generator=generator) * 0.02
            )
            tensors[f"{name}.lora_B.weight"] = (
                torch.randn(size_out, rank, generator=generator) * 0.02
            )
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / WEIGHTS_FILE)
    (out / CONFIG_FILE).write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank})
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args()
    model = bench_model_dir()
    adapters = [
        LoRARequest(
            name, str(write_adapter(model, model.parent / f"bench55m-lora-{name}", args.rank, seed))
        )
        for seed, name in enumerate(("a", "b"))
    ]
    llm = LLM(
        str(model), dtype=args.dtype, threads=args.threads, enable_lora=True,
        max_lora_rank=args.rank, kv_cache_memory="512MiB",
    )  # fmt: skip
    print(describe_cpu())
    print(
        f"bench55m {llm.core.dtype}, {args.batch} x {args.prompt} -> {args.new} tokens, r {args.rank}"
    )
    params = SamplingParams(max_tokens=args.new, temperature=0, ignore_eos=True)
    mixed = [None if i % 3 == 0 else adapters[i % 3 - 1] for i in range(args.batch)]
    batches = {"base only": [None] * args.batch, "base + 2 adapters": mixed}
    vocab = llm.core.model_config.vocab_size
    llm.generate(random_prompts(args.batch, args.prompt, vocab, 0), params, lora_request=mixed)
    best = dict.fromkeys(batches, 0.0)
    for round_ in range(args.repeat):
        for seed, (name, loras) in enumerate(batches.items(), start=1):
            prompts = random_prompts(args.batch, args.prompt, vocab, 100 * round_ + seed)
            started = time.perf_counter()
            llm.generate(prompts, params, lora_request=loras)
            rate = args.batch * args.new / (time.perf_counter() - started)
            best[name] = max(best[name], rate)
    for name, rate in best.items():
        print(f"{name:>18}: {rate:8.1f} output tok/s")
    ratio = best["base + 2 adapters"] / best["base only"]
    print(f"mixed / base-only: {ratio:.2f}")


if __name__ == "__main__":
    main()
