"""vLLM's CPU build, plain or with its n-gram speculation, for benchmarks/spec_decode_peers.py.

    VLLM_PY -P benchmarks/vllm_spec_runner.py < JOB.json     (started by spec_decode_peers.py)

It runs under vLLM's own venv (none of kvgate's packages), so it imports only vLLM and the
standard library. The job (stdin, one JSON object): ``model`` (a Hugging Face folder),
``prompts`` ({workload: [token ids]}), ``max_tokens``, ``speculative_config`` (null: plain).
Greedy, float32, prefix caching off. Per workload it generates 1 token, then ``max_tokens``
(stopping at EOS as kvgate does), and prints one line ``RESULT {json}``: the output tokens,
decode tok/s from the request's own first-to-last-token timestamps (``RequestOutput.metrics``,
kept when stats are on) and from the two walls ((n - 1) / (wall n - wall 1)), and the
``vllm:spec_decode_*`` counters the request moved.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

RESULT = "RESULT "
SPEC_COUNTERS = (
    "vllm:spec_decode_num_drafts",
    "vllm:spec_decode_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens",
)


def counters(llm: Any) -> dict[str, float]:
    totals = dict.fromkeys(SPEC_COUNTERS, 0.0)
    for metric in llm.get_metrics():
        if metric.name in totals:
            totals[metric.name] += float(getattr(metric, "value", 0.0))
    return totals


def main() -> None:
    from vllm import LLM, SamplingParams

    job = json.loads(sys.stdin.read())
    extra: dict[str, Any] = {}
    if job["speculative_config"] is not None:
        extra["speculative_config"] = job["speculative_config"]
    llm = LLM(
        model=job["model"],
        dtype="float32",
        max_model_len=4096,
        seed=0,
        enable_prefix_caching=False,
        disable_log_stats=False,  # keeps RequestOutput.metrics and the spec-decode counters
        **extra,
    )
    warm = [{"prompt_token_ids": [11, 12, 13, 14] * 16}]
    llm.generate(warm, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)

    def generate(ids: list[int], count: int) -> tuple[float, Any]:
        params = SamplingParams(max_tokens=count, temperature=0)
        start = time.perf_counter()
        (output,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return time.perf_counter() - start, output

    results: dict[str, Any] = {}
    for name, ids in job["prompts"].items():
        wall_one, _ = generate(ids, 1)
        before = counters(llm)
        wall, output = generate(ids, job["max_tokens"])
        after = counters(llm)
        tokens = list(output.outputs[0].token_ids)
        metrics = output.metrics
        stamped = None
        if metrics is not None and metrics.last_token_ts > metrics.first_token_ts > 0:
            stamped = (len(tokens) - 1) / (metrics.last_token_ts - metrics.first_token_ts)
        results[name] = {
            "tokens": tokens,
            "tok_s_timestamps": stamped,
            "tok_s_walls": (len(tokens) - 1) / (wall - wall_one) if wall > wall_one else None,
            "drafts": after[SPEC_COUNTERS[0]] - before[SPEC_COUNTERS[0]],
            "draft_tokens": after[SPEC_COUNTERS[1]] - before[SPEC_COUNTERS[1]],
            "accepted_tokens": after[SPEC_COUNTERS[2]] - before[SPEC_COUNTERS[2]],
        }
    print(RESULT + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
