"""vLLM's CPU build as a peer in benchmarks/engine.py: one process, driven over stdin/stdout.

    VLLM_PY benchmarks/vllm_peer.py MODEL_DIR DTYPE     (started by VllmPeer, not by hand)

It runs under vLLM's own venv (which has none of kvgate's packages), so this file imports only
vLLM and the standard library. Each stdin line is a JSON job ``{"prompts": [[ids]], "new": n}``;
each stdout line the job's wall seconds and per-request counts. The environment vLLM's CPU
backend wants (tcmalloc and Intel OpenMP preloaded, a KV cache size, threads bound to every
core) is set by `VllmPeer` from what it finds on the machine.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

READY = "vllm-peer-ready"


def peer_environment(python: str, threads: int) -> dict[str, str]:
    """vLLM's CPU settings: tcmalloc + iomp preloaded (~1.5x on 2 cores), 1 GiB of KV cache,
    OpenMP threads bound to the first ``threads`` cores (its default reserves one)."""
    env = dict(os.environ)
    venv = Path(python).resolve().parent.parent
    preload = glob.glob("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    preload += [str(p) for p in (venv / "lib").glob("libiomp5.so")]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload + [env.get("LD_PRELOAD", "")]).rstrip(":")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    env.pop("PYTHONPATH", None)
    return env


class VllmPeer:
    """The peer process, started once and kept for every round (its startup is ~1-2 min)."""

    def __init__(self, python: str, model_dir: Path, dtype: str, threads: int):
        self.process = subprocess.Popen(
            # -P: the script's folder (benchmarks/, whose openai.py would shadow the `openai`
            # package vLLM imports) is not put on sys.path.
            [python, "-P", __file__, str(model_dir), dtype],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=peer_environment(python, threads),
        )
        for line in self.process.stdout:
            if line.strip() == READY:
                return
        raise RuntimeError(f"the vLLM peer exited with {self.process.wait()} before it was ready")

    def run(self, prompts: list[list[int]], new: int) -> dict:
        self.process.stdin.write(json.dumps({"prompts": prompts, "new": new}) + "\n")
        self.process.stdin.flush()
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"the vLLM peer exited with {self.process.wait()}")

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def serve(model_dir: str, dtype: str) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype=dtype, max_model_len=4096, seed=0, enable_prefix_caching=True)
    warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [11] * 32}] * 2, warm, use_tqdm=False)
    print(READY, flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        new = job["new"]
        params = SamplingParams(max_tokens=new, min_tokens=new, temperature=0, ignore_eos=True)
        prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        counts = [len(o.outputs[0].token_ids) for o in outputs]
        cached = [o.num_cached_tokens or 0 for o in outputs]
        print(json.dumps({"wall": wall, "counts": counts, "cached": cached}), flush=True)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
