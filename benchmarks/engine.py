"""Engine vs transformers generate() on one model, in one process and one run.

    python benchmarks/engine.py [--threads 2] [--repeat 3] [--prompts 8] [--prompt-len 512]

Prints output tokens/s of each and their ratio (8 prompts x 512 tokens -> exactly 128 new
tokens each, greedy, bf16), single-stream decode tokens/s, and the time to first token of a
2,000-token prompt cold vs fully cached. The model is the "bench55m" tiny-model preset
(~55M parameters, random weights), built once into the kvgate cache directory.

The machine may be shared: each measurement is repeated (engine and transformers
alternating, fresh prompts each round so nothing is served from the prefix cache unless
meant to be) and the best round is reported, with the process CPU seconds beside it.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Run as a script, this file's directory comes first on sys.path and its name would shadow
# the `engine` package: put the repository root there instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import CACHE_ENV, make_tiny_model  # noqa: E402


@dataclass(frozen=True)
class Timing:
    wall: float
    cpu: float


def timed(fn: Callable[[], object]) -> Timing:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return Timing(time.perf_counter() - wall, time.process_time() - cpu)


def best(timings: list[Timing]) -> Timing:
    return min(timings, key=lambda t: t.wall)


def bench_model_dir() -> Path:
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvgate")
    path = cache / "bench55m-v1"
    if not (path / "model.safetensors").is_file():
        make_tiny_model(path, seed=0, preset="bench55m")
    return path


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


class Transformers:
    def __init__(self, path: Path, new: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
        self.new = new
        self.run(random_prompts(2, 32, 100, seed=99), 4)  # warm up

    def run(self, prompts: list[list[int]], new: int | None = None) -> None:
        new = new or self.new
        ids = torch.tensor(prompts)
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                do_sample=False,
                max_new_tokens=new,
                min_new_tokens=new,
                attention_mask=torch.ones_like(ids),
                pad_token_id=0,
            )
        assert out.shape == (len(prompts), len(prompts[0]) + new)


def engine_run(llm: LLM, prompts: list[list[int]], new: int) -> None:
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert all(len(o.token_ids) == new and o.cached_tokens == 0 for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--ttft-len", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = bench_model_dir()
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory="512MiB")
    vocab = llm.core.model_config.vocab_size
    engine_run(llm, random_prompts(2, 32, vocab, seed=98), 4)  # warm up
    hf = Transformers(path, args.new)
    print(f"model {path.name}, bf16, {args.threads} threads, best of {args.repeat} rounds")

    ours, theirs = [], []
    for round_ in range(args.repeat):
        prompts = random_prompts(args.prompts, args.prompt_len, vocab, seed=round_)
        ours.append(timed(lambda p=prompts: engine_run(llm, p, args.new)))
        theirs.append(timed(lambda p=prompts: hf.run(p)))
    tokens = args.prompts * args.new
    e, t = best(ours), best(theirs)
    print(f"{args.prompts} prompts x {args.prompt_len} tokens -> {args.new} new tokens each")
    print(f"  engine        {tokens / e.wall:8.1f} output tok/s  ({e.cpu:.1f} CPU s)")
    print(f"  transformers  {tokens / t.wall:8.1f} output tok/s  ({t.cpu:.1f} CPU s)")
    print(f"  ratio         {t.wall / e.wall:8.2f}x  (by CPU time {t.cpu / e.cpu:.2f}x)")

    first, whole = [], []
    for round_ in range(args.repeat):
        prompt = random_prompts(1, 16, vocab, seed=100 + round_)
        first.append(timed(lambda p=prompt: engine_run(llm, p, 1)))
        prompt = random_prompts(1, 16, vocab, seed=200 + round_)
        whole.append(timed(lambda p=prompt: engine_run(llm, p, args.new + 1)))
    print(f"single-stream decode {args.new / (best(whole).wall - best(first).wall):8.1f} tok/s")

    cold, cached = [], []
    one = SamplingParams(max_tokens=1, temperature=0)
    for round_ in range(args.repeat):
        prompt = random_prompts(1, args.ttft_len, vocab, seed=300 + round_)
        cold.append(timed(lambda p=prompt: engine_run(llm, p, 1)))
        cached.append(timed(lambda p=prompt: llm.generate(p, one)))
    hit = llm.generate(prompt, one)[0].cached_tokens
    c, h = best(cold), best(cached)
    print(
        f"TTFT {args.ttft_len}-token prompt: cold {c.wall * 1000:.0f} ms, cached "
        f"{h.wall * 1000:.0f} ms ({hit} tokens cached): {c.wall / h.wall:.1f}x faster "
        f"(by CPU time {c.cpu / h.cpu:.1f}x)"
    )


if __name__ == "__main__":
    main()
