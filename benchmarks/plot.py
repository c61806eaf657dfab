"""Plots of the benchmarks' JSON output for the docs (docs/benchmarks/*.png).

Each benchmark below writes its figures with ``--json PATH`` (``benchmarks/record.py``):

    python -m benchmarks.openai --vllm-python PY --vllm-bench --concurrency 1,4,16 --json openai.json
    python benchmarks/gguf.py --engines kvgate,llama.cpp --json gguf-q4_1.json   # and --as q8_0, bf16
    python benchmarks/fleet.py --workload overhead --json router.json

and this draws one PNG per benchmark from any of those files, titled with the CPU and date of
its run:

    python benchmarks/plot.py openai.json gguf-*.json router.json [--out docs/benchmarks]

- ``openai.png``: output throughput and TTFT p50 against concurrency, kvgate and vLLM (each
  point the round with the best throughput, as the benchmark reports it);
- ``gguf.png``: single-stream and 8-stream decode tokens per second per GGUF type, per engine;
- ``router.png``: CPU milliseconds per call and requests per second per router, non-streamed
  and streamed (means over the rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

Document = dict[str, Any]
OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"


def caption(documents: list[Document]) -> str:
    """The CPU(s) and date(s) the figures were measured on."""
    cpus = sorted({d["cpu"] for d in documents})
    dates = sorted({d["date"] for d in documents})
    span = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    return f"{'; '.join(cpus)}, {documents[0]['cores']} cores, {span}"


def openai(documents: list[Document]) -> Figure:
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for result in (r for d in documents for r in d["results"]):
        key = (result["server"], result["concurrency"])
        if key not in best or result["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = result
    figure, (throughput, ttft) = plt.subplots(1, 2, figsize=(10, 4.2), layout="constrained")
    for server in sorted({s for s, _ in best}):
        levels = sorted(c for s, c in best if s == server)
        points = [best[server, c] for c in levels]
        throughput.plot(levels, [p["tokens_per_s"] for p in points], marker="o", label=server)
        ttft.plot(levels, [p["ttft_p50_ms"] for p in points], marker="o", label=server)
    levels = sorted({c for _, c in best})
    for axes, label in ((throughput, "output tokens/s"), (ttft, "TTFT p50 (ms)")):
        axes.set_xlabel("concurrent streams")
        axes.set_ylabel(label)
        axes.set_xscale("log", base=2)
        axes.set_xticks(levels, [str(c) for c in levels])
        axes.grid(alpha=0.3)
        axes.legend()
    figure.suptitle(f"Serving: kvgate vs vLLM's OpenAI server\n{caption(documents)}")
    return figure


def gguf(documents: list[Document]) -> Figure:
    results = [r for d in documents for r in d["results"]]
    types = sorted({r["type"] for r in results})
    engines = sorted({r["engine"] for r in results}, key=lambda e: (e != "kvgate", e))
    figure, panels = plt.subplots(1, 2, figsize=(10, 4.2), layout="constrained")
    width = 0.8 / len(engines)
    for axes, field, title in zip(
        panels, ("tok_s", "streams8_tok_s"), ("single stream", "8 streams"), strict=True
    ):
        for i, engine in enumerate(engines):
            by_type = {r["type"]: r.get(field) for r in results if r["engine"] == engine}
            xs = [t + (i - (len(engines) - 1) / 2) * width for t in range(len(types))]
            heights = [by_type.get(kind) or 0.0 for kind in types]
            axes.bar(xs, heights, width, label=engine)
        axes.set_xticks(range(len(types)), types)
        axes.set_ylabel("decode tokens/s")
        axes.set_title(title)
        axes.grid(axis="y", alpha=0.3)
        axes.legend()
    figure.suptitle(f"GGUF decode: kvgate vs llama.cpp\n{caption(documents)}")
    return figure


def router(documents: list[Document]) -> Figure:
    runs: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for result in (r for d in documents for r in d["results"]):
        runs[result["router"], result["call"]].append(result)
    routers = list(dict.fromkeys(name for name, _ in runs))
    calls = ("non-streamed", "streamed")
    figure, panels = plt.subplots(1, 2, figsize=(10, 4.2), layout="constrained")
    width = 0.8 / len(calls)
    for axes, field, scale, label in zip(
        panels,
        ("server_us_per_request", "rps"),
        (1e-3, 1.0),
        ("CPU ms per call (all its processes)", "requests/s"),
        strict=True,
    ):
        for i, call in enumerate(calls):
            heights = [
                statistics.mean(r[field] for r in runs[name, call]) * scale
                if runs.get((name, call))
                else 0.0
                for name in routers
            ]
            xs = [x + (i - 0.5) * width for x in range(len(routers))]
            axes.bar(xs, heights, width, label=call)
        axes.set_xticks(range(len(routers)), routers, rotation=15, ha="right")
        axes.set_ylabel(label)
        axes.grid(axis="y", alpha=0.3)
        axes.legend()
    figure.suptitle(f"Router overhead: three instant upstreams\n{caption(documents)}")
    return figure


PLOTS: dict[str, Callable[[list[Document]], Figure]] = {
    "openai": openai,
    "gguf": gguf,
    "router": router,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="JSON files the benchmarks wrote with --json")
    parser.add_argument("--out", default=str(OUT), help="folder for the PNGs")
    args = parser.parse_args()
    by_benchmark: dict[str, list[Document]] = defaultdict(list)
    for name in args.files:
        document = json.loads(Path(name).read_text())
        if document.get("benchmark") not in PLOTS:
            raise SystemExit(f"{name}: not a benchmark this script plots ({sorted(PLOTS)})")
        by_benchmark[document["benchmark"]].append(document)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for benchmark, documents in by_benchmark.items():
        figure = PLOTS[benchmark](documents)
        path = out / f"{benchmark}.png"
        figure.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(figure)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
