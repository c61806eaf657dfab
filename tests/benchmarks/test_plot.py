"""benchmarks/plot.py draws what the benchmarks write with --json (benchmarks/record.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from benchmarks import plot, record  # noqa: E402


def written(tmp_path: Path, name: str, benchmark: str, results: list[dict]) -> str:
    path = tmp_path / name
    record.write(str(path), benchmark, results)
    document = json.loads(path.read_text())
    assert document["cpu"] and document["date"] and document["results"] == results
    return str(path)


def test_each_benchmark_json_becomes_its_png(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    serving = [
        {"server": s, "concurrency": c, "round": 0, "tokens_per_s": 100.0 * c, "ttft_p50_ms": 40.0}
        for s in ("kvgate", "vllm")
        for c in (1, 16)
    ]
    decode = [
        {"engine": e, "type": "Q4_1", "tok_s": 150.0, "streams8_tok_s": 360.0}
        for e in ("kvgate", "llama.cpp")
    ]
    routing = [
        {"router": r, "call": c, "round": 0, "rps": 7000.0, "server_us_per_request": 224.0}
        for r in ("kvgate", "sglang-router cache_aware")
        for c in ("non-streamed", "streamed")
    ]
    files = [
        written(tmp_path, "openai.json", "openai", serving),
        written(tmp_path, "gguf.json", "gguf", decode),
        written(tmp_path, "router.json", "router", routing),
    ]
    out = tmp_path / "png"
    monkeypatch.setattr(sys, "argv", ["plot.py", *files, "--out", str(out)])
    plot.main()
    for name in ("openai", "gguf", "router"):
        assert (out / f"{name}.png").read_bytes().startswith(b"\x89PNG")


def test_a_file_of_another_kind_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = written(tmp_path, "x.json", "soak", [{"calls": 1}])
    monkeypatch.setattr(sys, "argv", ["plot.py", path, "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="not a benchmark this script plots"):
        plot.main()
