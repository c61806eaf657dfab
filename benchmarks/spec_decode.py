"""Speculative decoding on agent-shaped replies: decode tok/s with and without drafts, same run.

    python benchmarks/spec_decode.py [--model smollm2] [--dtype auto] [--gguf-dequantize]
        [--threads 2] [--max-tokens 256] [--speculative-config JSON] [--streams 8] [--rounds 3]
        [--json PATH]

Three single-stream workloads, greedy, through the chat template:

- edit:  a ~1,000-token Python file (kvgate's own scheduler) and "repeat this code with the
         variable renamed", the reply begun with the code fence and the class line, as an agent
         that starts its model's answer does (vLLM's ``continue_final_message``): SmolLM2-135M
         then re-emits the file (asked without the start, it explains the code instead);
- json:  a JSON document to rewrite with one key renamed;
- story: a short story, which repeats nothing.

Decode tok/s is (output tokens - 1) over the engine's own first-to-last-token time;
speculation's outputs are checked against the plain ones. Then ``--streams`` concurrent edit
requests, output tok/s: plain, speculation with its batch back-off, and speculation forced on
every step (where it stops paying). Acceptance rate is accepted / draft tokens; mean accepted
length is 1 + accepted / drafts (vLLM's figures).

Each of ``--rounds`` rounds measures plain and speculating back to back, workload by workload
(plain first in even rounds, speculating first in odd ones), with speculating engines made
afresh (suffix decoding would otherwise draft from its own replies to the same prompts a round
before); printed: the medians, and the spread of the rounds' own ratios, which a neighbour's
load on a shared machine moves.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the repository, not benchmarks/

from benchmarks import record  # noqa: E402
from kvgate.engine import LLM, SamplingParams  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SPEC = '{"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


REPLY_STARTS = {"edit": "```python\nclass Scheduler:"}  # the answer as the caller begins it


def workloads() -> dict[str, str]:
    code = (
        (ROOT / "kvgate/engine/core/scheduler.py").read_text().split("class Scheduler:")[1][:3600]
    )
    document = {
        "tools": [
            {
                "name": f"tool_{i}",
                "description": f"Runs step {i} of the pipeline",
                "timeout": 30 + i,
            }
            for i in range(12)
        ]
    }
    return {
        "edit": "Repeat this code with the variable `budget` renamed to `token_budget`. "
        f"Output only the code.\n\n```python\nclass Scheduler:{code}\n```",
        "json": "Rewrite this JSON with the key `timeout` renamed to `timeout_s`. Output only the "
        f"JSON.\n\n{json.dumps(document, indent=2)}",
        "story": "Write a story about a lighthouse keeper who finds a message in a bottle.",
    }


def prompts_from(tokenizer: Any) -> dict[str, list[int]]:
    """The workloads as token ids: the chat turn, then the reply's start where it has one."""
    return {
        name: tokenizer.encode_chat([{"role": "user", "content": text}])
        + tokenizer.encode(REPLY_STARTS.get(name, ""), add_special_tokens=False)
        for name, text in workloads().items()
    }


def run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - start, [o.token_ids for o in outputs]


def single(llm: LLM, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Decode tok/s of one stream (its first to last token, as the engine timed them) and
    its tokens."""
    before = llm.stats().serving.histograms["request_decode_time_seconds"].total
    _, (tokens,) = run(llm, [prompt], max_tokens)
    decode = llm.stats().serving.histograms["request_decode_time_seconds"].total - before
    return (len(tokens) - 1) / decode, tokens


def acceptance(llm: LLM, before: Any) -> dict[str, float]:
    spec = llm.stats().serving.spec
    drafts, drafted = spec.drafts - before.drafts, spec.draft_tokens - before.draft_tokens
    accepted = spec.accepted_tokens - before.accepted_tokens
    return {
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_accepted_length": 1 + accepted / drafts if drafts else 1.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--gguf-dequantize", action="store_true", help="dense weights in --dtype, not the blocks"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--speculative-config", default=DEFAULT_SPEC)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    common = dict(
        model=args.model,
        dtype=args.dtype,
        gguf_dequantize=args.gguf_dequantize,
        threads=args.threads,
        enable_prefix_caching=False,
        kv_cache_memory="512MiB",
    )
    spec = json.loads(args.speculative_config)
    variants = {
        "spec": spec,
        "spec, no back-off": {**spec, "disable_by_batch_size": 10**6},
    }
    plain = LLM(**common)
    tokenizer = plain.core.tokenizer
    prompts = prompts_from(tokenizer)
    run(plain, [prompts["story"][:64]], 8)  # warm up
    print(
        f"{record.cpu_model()}, {args.threads} threads, {args.model}"
        f"{' dequantized' if args.gguf_dequantize else ''}, dtype {plain.core.dtype}, "
        f"{args.speculative_config}, "
        f"{args.rounds} rounds (median; min-max of the same-round ratios)"
    )
    rounds: list[dict[str, dict[str, Any]]] = []
    for number in range(args.rounds):
        # Fresh speculating engines each round: suffix decoding would otherwise draft from
        # the replies it saw to the same prompts a round before.
        engines = {
            "plain": plain,
            **{k: LLM(**common, speculative_config=v) for k, v in variants.items()},
        }
        run(engines["spec"], [prompts["story"][:64]], 8)
        figures: dict[str, dict[str, Any]] = {}
        for name, prompt in prompts.items():
            before = engines["spec"].stats().serving.spec.copy()
            # Odd rounds measure speculation first: a neighbour's load that rises or falls
            # through a round then favours neither.
            if number % 2:
                spec_rate, spec_tokens = single(engines["spec"], prompt, args.max_tokens)
                plain_rate, plain_tokens = single(plain, prompt, args.max_tokens)
            else:
                plain_rate, plain_tokens = single(plain, prompt, args.max_tokens)
                spec_rate, spec_tokens = single(engines["spec"], prompt, args.max_tokens)
            figures[name] = dict(
                plain_tok_s=plain_rate, spec_tok_s=spec_rate, speedup=spec_rate / plain_rate,
                identical=plain_tokens == spec_tokens, prompt_tokens=len(prompt),
                output_tokens=len(plain_tokens),
                same_prefix=sum(a == b for a, b in zip(plain_tokens, spec_tokens, strict=False)),
                **acceptance(engines["spec"], before),
            )  # fmt: skip
        batch = [prompts["edit"]] * args.streams
        for label, llm in list(engines.items())[:: -1 if number % 2 else 1]:
            wall, outputs = run(llm, batch, args.max_tokens)
            rate = sum(len(o) for o in outputs) / wall
            figures[f"edit x{args.streams} {label}"] = dict(output_tok_s=rate)
        for name, figure in figures.items():
            if name.startswith("edit x") and not name.endswith("plain"):
                base = figures[f"edit x{args.streams} plain"]["output_tok_s"]
                figure["speedup"] = figure["output_tok_s"] / base
        rounds.append(figures)
    results = []
    for name in rounds[0]:
        each = [r[name] for r in rounds]
        median = {k: statistics.median(f[k] for f in each) for k in each[0] if k != "identical"}
        ratios = [f["speedup"] for f in each if "speedup" in f]
        spread = f"({min(ratios):.2f}-{max(ratios):.2f})" if ratios else ""
        if "plain_tok_s" in median:
            agree = all(f["identical"] for f in each)
            print(
                f"{name:6} prompt {median['prompt_tokens']:5.0f}  out {median['output_tokens']:4.0f}  "
                f"plain {median['plain_tok_s']:6.1f} tok/s  spec {median['spec_tok_s']:6.1f} tok/s  "
                f"x{median['speedup']:4.2f} {spread}  acceptance {median['acceptance_rate']:.2f}  "
                f"mean accepted length {median['mean_accepted_length']:.2f}  identical {agree}"
            )
            results.append(dict(workload=name, identical=agree, **median))
        else:
            ratio = f"x{median['speedup']:4.2f} {spread}" if ratios else ""
            print(f"{name:26} {median['output_tok_s']:6.1f} output tok/s  {ratio}")
            results.append(dict(workload=name, **median))
    record.write(args.json, "spec_decode", results)


if __name__ == "__main__":
    main()
