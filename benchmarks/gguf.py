"""A GGUF file in kvgate (weights kept quantized, and dequantized at load) vs llama.cpp (its Python bindings, `llama-cpp-python`) and
transformers' own GGUF loader, in one run: load time, resident memory, single-stream decode,
8 concurrent streams and a 1,000-token time to first token.

    python benchmarks/gguf.py [FILE.gguf] [--as bf16|q8_0|q4_k_m] [--dtype bfloat16|float32]
                              [--tokens 128] [--threads 2] [--repeat 3]
                              [--engines kvgate,kvgate-dequantized,llama.cpp,transformers]

FILE defaults to the SmolLM2-135M-Instruct Q4_1 file (`kvgate fetch-model smollm2`). `--as`
first rewrites it with llama.cpp's own quantizer (`llama_model_quantize`, requantizing allowed)
into a BF16, Q8_0 or Q4_K_M file (where a model's rows are not whole 256-value
super-blocks llama.cpp writes Q5_0/Q8_0 there instead), cached beside it, which every engine then reads: the same bytes.
llama.cpp is skipped where `llama_cpp` is not installed (`CMAKE_ARGS="-DGGML_NATIVE=ON" pip
install llama-cpp-python`, ~8 min on 2 cores).

Each engine runs in a fresh process of its own, so its memory figures are its own:
- RSS after load: the engine ready to serve, its KV cache included (kvgate 64 MiB;
  llama.cpp a 2,048-token context in f16, 47 MB for SmolLM2); the load's peak (VmHWM then,
  imports included) and the peak over the whole run;
- decode tok/s: one chat prompt generating `--tokens` new tokens less a 1-token run;
- 8 streams: 8 chat prompts x `--tokens` new tokens, total tok/s. kvgate batches them
  (`LLM.generate`); llama.cpp's server (`llama_cpp.server`) takes one request at a time, so
  its figure is the 8 run one after another through the bindings (an upper bound of its
  server's, which adds HTTP); transformers is not run here;
- TTFT: a 1,000-token prompt (fresh random ids each round, so no prefix is reused) to its
  first token.
Best of `--repeat` rounds each. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not benchmarks/

from benchmarks import record  # noqa: E402
from benchmarks.machine import describe_cpu  # noqa: E402

CHATS = [
    "Tell me about the history of Paris in detail.",
    "Write a long poem about the sea.",
    "Explain how a CPU executes instructions.",
    "Describe the water cycle step by step.",
    "What are the main causes of inflation?",
    "Write a story about a robot learning to paint.",
    "How do vaccines train the immune system?",
    "Summarize the plot of a heist movie you invent.",
]
ENGINES = ("kvgate", "kvgate-dequantized", "llama.cpp", "transformers")
# Run in a fresh interpreter per engine: prints one JSON line of figures.
WORKER = r"""
import json, random, resource, sys, time

def rss_mb(key="VmRSS"):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024

engine, path, dtype, tokens, threads, repeat, chats = sys.argv[1:8]
tokens, threads, repeat, chats = int(tokens), int(threads), int(repeat), json.loads(chats)
if engine.startswith("kvgate"):
    import torch
    torch.set_num_threads(threads)
    from kvgate.engine import LLM, SamplingParams
    from kvgate.engine import native
    native.library()  # loaded first: not the file's load
base = rss_mb()
start = time.perf_counter()
if engine.startswith("kvgate"):
    llm = LLM(path, dtype=dtype, kv_cache_memory="64MiB", threads=threads,
              gguf_dequantize=engine == "kvgate-dequantized")
    load = time.perf_counter() - start
    prompts = [llm.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in chats]
    vocab = llm.tokenizer.vocab_size
    def generate(batch, new):
        llm.generate(batch, SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
    def streams(batch, new):
        generate(batch, new)
elif engine == "llama.cpp":
    import llama_cpp
    model = llama_cpp.Llama(
        model_path=path, n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads,
        verbose=False,
    )
    load = time.perf_counter() - start
    # SmolLM2's chat template (ChatML), written out: the bindings' generate() takes tokens.
    prompts = [
        model.tokenize(f"<|im_start|>user\n{c}<|im_end|>\n<|im_start|>assistant\n".encode(),
                       add_bos=False, special=True)
        for c in chats
    ]
    vocab = model.n_vocab()
    def generate(batch, new):
        for prompt in batch:
            model.reset()
            for count, _ in enumerate(model.generate(prompt, top_k=1, temp=0.0), 1):
                if count == new:
                    break
    streams = generate  # one request at a time, as its server serves them
else:
    import torch
    torch.set_num_threads(threads)
    import transformers
    folder, name = path.rsplit("/", 1)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=getattr(torch, dtype)
    ).eval()
    load = time.perf_counter() - start
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
        for c in chats
    ]
    prompts = [p if isinstance(p, list) else p["input_ids"] for p in prompts]
    vocab = len(tokenizer)
    def generate(batch, new):
        for prompt in batch:
            with torch.no_grad():
                model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new,
                               do_sample=False)
    streams = None
after_load, load_peak = rss_mb(), rss_mb("VmHWM")

def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start

generate(prompts[:1], tokens)  # warm-up
figures = {"load_s": load, "base_mb": base, "after_load_mb": after_load, "load_peak_mb": load_peak}
decode = min(timed(generate, prompts[:1], tokens) - timed(generate, prompts[:1], 1)
             for _ in range(repeat))
figures["tok_s"] = (tokens - 1) / decode
if streams is not None:
    figures["streams8_tok_s"] = 8 * tokens / min(timed(streams, prompts, tokens)
                                                 for _ in range(repeat))
rng = random.Random(7)
figures["ttft_ms"] = 1000 * min(
    timed(generate, [[rng.randrange(100, vocab - 100) for _ in range(1000)]], 1)
    for _ in range(repeat)
)
figures["peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(figures))
"""


def measure(engine: str, path: Path, args: argparse.Namespace) -> dict[str, float]:
    command = [sys.executable, "-c", WORKER, engine, str(path), args.dtype, str(args.tokens)]
    done = subprocess.run(
        [*command, str(args.threads), str(args.repeat), json.dumps(CHATS)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    if done.returncode != 0:
        raise SystemExit(f"{engine} failed:\n{done.stderr[-3000:]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def requantized(source: Path, kind: str) -> Path:
    """``source`` rewritten by llama.cpp's quantizer as ``kind`` (cached beside it)."""
    import llama_cpp

    types = {
        "bf16": llama_cpp.LLAMA_FTYPE_MOSTLY_BF16,
        "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
        "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    }
    target = source.with_name(f"{source.stem.rsplit('.', 1)[0]}.{kind.upper()}.gguf")
    if not target.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = types[kind]
        params.allow_requantize = True
        params.nthread = 2
        partial = target.with_suffix(".partial")
        failed = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params)
        if failed:
            raise SystemExit(f"llama_model_quantize to {kind} failed ({failed})")
        partial.replace(target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", help="a .gguf file (default: the smollm2 one)")
    parser.add_argument("--as", dest="as_type", choices=["bf16", "q8_0", "q4_k_m"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = parser.parse_args()
    if args.file is None:
        from kvgate.engine.loading.fetch_model import fetch_model

        path = fetch_model("smollm2")
    else:
        path = Path(args.file)
    if args.as_type:
        path = requantized(path, args.as_type)
    engines = args.engines.split(",")
    if "llama.cpp" in engines:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print("llama.cpp: skipped (llama-cpp-python is not installed)")
            engines.remove("llama.cpp")
    print(describe_cpu())
    print(f"{path.name} ({path.stat().st_size / 1e6:.0f} MB), {args.dtype}, {args.threads} threads")
    results = {engine: measure(engine, path, args) for engine in engines}
    header = ("load s", "RSS base", "after load", "load peak", "run peak", "decode tok/s")
    header += ("8 streams", "TTFT ms")
    print(f"{'':19}" + "".join(f"{h:>13}" for h in header))
    for engine, r in results.items():
        row = (r["load_s"], r["base_mb"], r["after_load_mb"], r["load_peak_mb"], r["peak_mb"])
        row += (r["tok_s"],)
        cells = [f"{x:13.1f}" for x in row]
        cells.append(f"{r['streams8_tok_s']:13.1f}" if "streams8_tok_s" in r else f"{'-':>13}")
        cells.append(f"{r['ttft_ms']:13.0f}")
        print(f"{engine:19}" + "".join(cells))
    kind = args.as_type or path.stem.rsplit(".", 1)[-1]  # SmolLM2-135M-Instruct.Q4_1
    measured = [
        {"engine": e, "type": kind.upper(), "file": path.name, **r} for e, r in results.items()
    ]
    record.write(args.json, "gguf", measured)
    ours = results.get("kvgate")
    for peer, theirs in results.items():
        if ours is None or peer == "kvgate":
            continue
        line = (
            f"kvgate / {peer}: decode {ours['tok_s'] / theirs['tok_s']:.2f}x, "
            f"TTFT {ours['ttft_ms'] / theirs['ttft_ms']:.2f}x (lower is faster), "
            f"RSS after load {ours['after_load_mb'] / theirs['after_load_mb']:.2f}x"
        )
        if "streams8_tok_s" in theirs:
            line += f", 8 streams {ours['streams8_tok_s'] / theirs['streams8_tok_s']:.2f}x"
        print(line)


if __name__ == "__main__":
    main()
