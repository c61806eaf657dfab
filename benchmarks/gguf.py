"""A GGUF file in kvgate (weights kept quantized, and dequantized at load) vs transformers' own
GGUF loader, in one run: load time, resident memory (after imports, peak during the load, after
load) and single-stream decode tok/s.

    python benchmarks/gguf.py [FILE.gguf] [--dtype bfloat16|float32] [--tokens 128]
        [--prompt-tokens 128] [--threads 2] [--rounds 2] [--engines kvgate,kvgate-dequantized]

FILE defaults to the SmolLM2-135M-Instruct Q4_1 file (`kvgate fetch-model smollm2`). Each
engine loads in its own fresh process, so its memory figures are its own; kvgate's load time
and RSS after load are the file's load alone (model, tokenizer), before the engine around it
(KV cache, attention kernels) is built; "peak" is the process's high-water mark at that point
(VmHWM: the load's peak, imports included). Decode tok/s is a `--prompt-tokens` prompt
generating `--tokens` new tokens less a 1-token run (prefill excluded), best of 3. The engines
run in turn, `--rounds` times (interleaved: load drifts hit them alike); each figure is the
best over rounds. transformers dequantizes at load. Run it on an otherwise idle machine
(`flock /tmp/kvgate-bench.lock`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not benchmarks/

from benchmarks.machine import describe_cpu  # noqa: E402

TEXT = "Tell me about the history of Paris in detail. " * 64  # cut to --prompt-tokens tokens
ENGINES = ("kvgate", "kvgate-dequantized", "transformers")
# Run in a fresh interpreter per engine: prints one JSON line of figures.
WORKER = r"""
import json, sys, time

def rss_mb(key="VmRSS"):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024

engine, path, dtype, tokens, threads, text, prompt_tokens = sys.argv[1:8]
tokens, prompt_tokens = int(tokens), int(prompt_tokens)
import torch
torch.set_num_threads(int(threads))
if engine.startswith("kvgate"):
    from pathlib import Path
    from engine import LLM, SamplingParams
    from engine.model_source import load_model_at
    from engine.models import quantized_linear
    dequantize = engine == "kvgate-dequantized"
    quantized_linear.load()  # built (or loaded) before the figures: not the file's load
    base = rss_mb()
    start = time.perf_counter()
    loaded = load_model_at(Path(path), dtype, gguf_dequantize=dequantize)  # no KV cache yet
    load = time.perf_counter() - start
    after_load, peak = rss_mb(), rss_mb("VmHWM")
    del loaded
    llm = LLM(path, dtype=dtype, kv_cache_memory="64MiB", threads=int(threads),
              gguf_dequantize=dequantize)
    prompt = llm.tokenizer.encode(text)[:prompt_tokens]
    def run(new):
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([prompt], params)
        return time.perf_counter() - start
else:
    import transformers
    base = rss_mb()
    folder, name = path.rsplit("/", 1)
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=getattr(torch, dtype)
    ).eval()
    load = time.perf_counter() - start
    after_load, peak = rss_mb(), rss_mb("VmHWM")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][:prompt_tokens]
    prompt = torch.tensor([ids])
    def run(new):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return time.perf_counter() - start
run(tokens)  # warm-up
decode = min(run(tokens) - run(1) for _ in range(3))
print(json.dumps({"load_s": load, "base_mb": base, "after_load_mb": after_load,
                  "peak_mb": peak, "tok_s": (tokens - 1) / decode}))
"""


def measure(engine: str, path: Path, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, "-c", WORKER, engine, str(path), args.dtype, str(args.tokens)]
    done = subprocess.run(
        [*command, str(args.threads), TEXT, str(args.prompt_tokens)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        check=True,
    )
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", help="a .gguf file (default: the smollm2 one)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--engines", default=",".join(ENGINES), help="comma list of " + str(ENGINES)
    )
    args = parser.parse_args()
    engines = args.engines.split(",")
    if not set(engines) <= set(ENGINES):
        parser.error(f"--engines: expected some of {ENGINES}")
    if args.file is None:
        from engine.fetch_model import fetch_model

        path = fetch_model("smollm2")
    else:
        path = Path(args.file)
    print(describe_cpu())
    print(f"{path.name} ({path.stat().st_size / 1e6:.0f} MB), {args.dtype}, {args.threads} threads")
    runs: dict[str, list[dict[str, float]]] = {engine: [] for engine in engines}
    for _ in range(args.rounds):
        for engine in engines:
            runs[engine].append(measure(engine, path, args))
    results = {engine: best(figures) for engine, figures in runs.items()}
    print(f"{'':20}{'load s':>8}{'RSS base':>10}{'peak':>8}{'after load':>12}{'decode tok/s':>14}")
    for engine, r in results.items():
        print(
            f"{engine:20}{r['load_s']:8.1f}{r['base_mb']:10.0f}{r['peak_mb']:8.0f}"
            f"{r['after_load_mb']:12.0f}{r['tok_s']:14.1f}"
        )
    for engine in engines[1:]:
        ours, theirs = results[engines[0]], results[engine]
        print(
            f"{engines[0]} / {engine}: decode {ours['tok_s'] / theirs['tok_s']:.2f}x, "
            f"load time {ours['load_s'] / theirs['load_s']:.2f}x, "
            f"RSS after load {ours['after_load_mb'] / theirs['after_load_mb']:.2f}x"
        )


def best(figures: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's best over the rounds: the most tok/s, the least time and memory."""
    return {key: (max if key == "tok_s" else min)(f[key] for f in figures) for key in figures[0]}


if __name__ == "__main__":
    main()
