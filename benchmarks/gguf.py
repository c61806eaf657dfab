"""A GGUF file in kvgate vs transformers' own GGUF loader, in one run: load time, resident
memory (after imports, peak, after load) and single-stream decode tok/s.

    python benchmarks/gguf.py [FILE.gguf] [--dtype bfloat16|float32] [--tokens 128] [--threads 2]

FILE defaults to the SmolLM2-135M-Instruct Q4_1 file (`kvgate fetch-model smollm2`). Each
engine loads in its own fresh process, so its memory figures are its own; kvgate's load time
and RSS after load are the file's load alone (model, tokenizer), before the engine around it
(KV cache, attention kernels) is built; peak RSS is over the whole run. Decode tok/s is one
chat prompt generating `--tokens` new tokens less a 1-token run (prefill excluded), best of 3.
Both engines dequantize the file at load (kvgate has no quantized matmul yet). Run it on an
otherwise idle machine (`flock /tmp/kvgate-bench.lock`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not benchmarks/

from benchmarks.machine import describe_cpu  # noqa: E402

CHAT = [{"role": "user", "content": "Tell me about the history of Paris in detail."}]
# Run in a fresh interpreter per engine: prints one JSON line of figures.
WORKER = r"""
import json, resource, sys, time

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

engine, path, dtype, tokens, threads, chat = sys.argv[1:7]
tokens, chat = int(tokens), json.loads(chat)
import torch
torch.set_num_threads(int(threads))
if engine == "kvgate":
    from pathlib import Path
    from engine import LLM, SamplingParams
    from engine.model_source import load_model_at
    base = rss_mb()
    start = time.perf_counter()
    loaded = load_model_at(Path(path), dtype)  # the file alone: no KV cache, no kernel build
    load = time.perf_counter() - start
    after_load = rss_mb()
    del loaded
    llm = LLM(path, dtype=dtype, kv_cache_memory="64MiB", threads=int(threads))
    prompt = llm.tokenizer.encode_chat(chat)
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
    after_load = rss_mb()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    prompt = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    def run(new):
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
run(tokens)  # warm-up
decode = min(run(tokens) - run(1) for _ in range(3))
print(json.dumps({"load_s": load, "base_mb": base, "after_load_mb": after_load,
                  "peak_mb": peak, "tok_s": (tokens - 1) / decode}))
"""


def measure(engine: str, path: Path, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, "-c", WORKER, engine, str(path), args.dtype, str(args.tokens)]
    done = subprocess.run(
        [*command, str(args.threads), json.dumps(CHAT)],
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
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if args.file is None:
        from engine.fetch_model import fetch_model

        path = fetch_model("smollm2")
    else:
        path = Path(args.file)
    print(describe_cpu())
    print(f"{path.name} ({path.stat().st_size / 1e6:.0f} MB), {args.dtype}, {args.threads} threads")
    results = {engine: measure(engine, path, args) for engine in ("kvgate", "transformers")}
    print(f"{'':14}{'load s':>8}{'RSS base':>10}{'peak':>8}{'after load':>12}{'decode tok/s':>14}")
    for engine, r in results.items():
        print(
            f"{engine:14}{r['load_s']:8.1f}{r['base_mb']:10.0f}{r['peak_mb']:8.0f}"
            f"{r['after_load_mb']:12.0f}{r['tok_s']:14.1f}"
        )
    ours, theirs = results["kvgate"], results["transformers"]
    print(
        f"kvgate / transformers: decode {ours['tok_s'] / theirs['tok_s']:.2f}x, "
        f"load time {ours['load_s'] / theirs['load_s']:.2f}x, "
        f"RSS after load {ours['after_load_mb'] / theirs['after_load_mb']:.2f}x"
    )


if __name__ == "__main__":
    main()
