"""Engine vs transformers generate() on one model, in one process and one run.

    python benchmarks/engine.py [--threads 2] [--prompts 8] [--prompt-len 512] [--new 128]

Prints output tokens/s of each and their ratio (8 prompts x 512 tokens -> exactly 128 new
tokens each, greedy, bf16), single-stream decode tokens/s, and the time to first token of a
2,000-token prompt cold vs fully cached. The model is the "bench55m" tiny-model preset
(~55M parameters, random weights), built once into the kvgate cache directory.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

# Run as a script, this file's directory comes first on sys.path and its name would shadow
# the `engine` package: put the repository root there instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402
from engine.tiny_model import CACHE_ENV, make_tiny_model  # noqa: E402


def bench_model_dir() -> Path:
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvgate")
    path = cache / "bench55m-v1"
    if not (path / "model.safetensors").is_file():
        make_tiny_model(path, seed=0, preset="bench55m")
    return path


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(count)]


CPU_SECONDS: dict[str, float] = {}  # process CPU time per measurement (robust to contention)


def timed(fn, label: str = "") -> tuple[float, object]:
    start, cpu = time.perf_counter(), time.process_time()
    result = fn()
    if label:
        CPU_SECONDS[label] = time.process_time() - cpu
    return time.perf_counter() - start, result


def bench_transformers(path: Path, prompts: list[list[int]], new: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ids = torch.tensor(prompts)
    kwargs = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new,
                  attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids[:, :32], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})
        seconds, out = timed(lambda: model.generate(ids, **kwargs), "transformers")
    assert out.shape == (len(prompts), len(prompts[0]) + new)
    return len(prompts) * new / seconds


def bench_engine(llm: LLM, prompts: list[list[int]], new: int) -> float:
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    llm.generate([p[:32] for p in prompts], SamplingParams(max_tokens=4, temperature=0))
    seconds, outputs = timed(lambda: llm.generate(prompts, params), "engine")
    assert all(len(o.token_ids) == new for o in outputs)
    return len(prompts) * new / seconds


def single_stream(llm: LLM, vocab: int, new: int) -> float:
    prompt = random_prompts(1, 16, vocab, seed=7)[0]
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))  # prefill + warm
    params = SamplingParams(max_tokens=new + 1, temperature=0, ignore_eos=True)
    first, _ = timed(lambda: llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0)))
    seconds, _ = timed(lambda: llm.generate([prompt], params))
    return new / (seconds - first)  # tokens after the first one, per second


def ttft(llm: LLM, vocab: int, length: int) -> tuple[float, float]:
    prompt = random_prompts(1, length, vocab, seed=11)[0]
    params = SamplingParams(max_tokens=1, temperature=0)
    cold, out = timed(lambda: llm.generate([prompt], params), "cold")
    assert out[0].cached_tokens == 0
    warm, out = timed(lambda: llm.generate([prompt], params), "cached")
    assert out[0].cached_tokens == (length - 1) // 16 * 16
    return cold, warm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--ttft-len", type=int, default=2000)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = bench_model_dir()
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory="512MiB")
    vocab = llm.core.model_config.vocab_size
    prompts = random_prompts(args.prompts, args.prompt_len, vocab, seed=0)
    print(f"model {path.name}, bf16, {args.threads} threads, {args.prompts} prompts x "
          f"{args.prompt_len} tokens -> {args.new} new tokens each, greedy")
    engine_rate = bench_engine(llm, prompts, args.new)
    print(f"engine        {engine_rate:8.1f} output tok/s  ({CPU_SECONDS['engine']:.1f} CPU s)")
    if not args.skip_transformers:
        hf_rate = bench_transformers(path, prompts, args.new)
        print(f"transformers  {hf_rate:8.1f} output tok/s  ({CPU_SECONDS['transformers']:.1f} CPU s)")
        print(f"ratio         {engine_rate / hf_rate:8.2f}x  (by CPU time "
              f"{CPU_SECONDS['transformers'] / CPU_SECONDS['engine']:.2f}x)")
    print(f"single-stream decode {single_stream(llm, vocab, args.new):8.1f} tok/s")
    cold, warm = ttft(llm, vocab, args.ttft_len)
    print(f"TTFT {args.ttft_len}-token prompt: cold {cold * 1000:.0f} ms, "
          f"cached {warm * 1000:.0f} ms, {cold / warm:.1f}x faster cached "
          f"(by CPU time {CPU_SECONDS['cold'] / CPU_SECONDS['cached']:.1f}x)")


if __name__ == "__main__":
    main()
