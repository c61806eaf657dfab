"""The hostile clients of ``benchmarks.hostile``'s ``tools`` case (issue 27): bodies of many
tools' JSON Schemas, huge ``choice`` lists, the victim tenant's stream, and the engine's
compiled-grammar figures read from ``/metrics``."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

KEYS = {"attacker": "attacker-key", "victim": "victim-key"}


def tool_body(seed: int, tools: int, size: int) -> bytes:
    """An OpenAI chat of ``tools`` distinct function schemas, at most ``size`` bytes."""
    field = {
        "type": "object",
        "description": f"a field of attacker {seed}",
        "properties": {f"a{k}": {"type": "string", "enum": ["x", "y", "z"]} for k in range(3)},
        "required": ["a0"],
    }

    def tool(i: int, fields: int) -> dict[str, Any]:
        properties = {f"p{i}_{j}": field for j in range(fields)}
        parameters = {"type": "object", "properties": properties}
        function = {"name": f"tool_{seed}_{i}", "description": f"tool {i}"}
        return {"type": "function", "function": {**function, "parameters": parameters}}

    one, two = len(orjson.dumps(tool(tools, 1))), len(orjson.dumps(tool(tools, 2)))
    per_field = two - one  # and one field's worth of the tool around it
    per_tool = max(1, ((size - 256) // tools - one + per_field) // per_field)
    functions = [tool(i, per_tool) for i in range(tools)]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": functions, "max_tokens": 1}
    return orjson.dumps(body)


def choice_body(seed: int, choices: int) -> bytes:
    """A completion constrained to one of ``choices`` distinct strings."""
    listed = [f"c{seed}x{i}" for i in range(choices)]
    body = {"prompt": "Pick one:", "max_tokens": 1, "structured_outputs": {"choice": listed}}
    return orjson.dumps(body)


def openai_post(base: str, path: str, content: bytes, key: str) -> str:
    """``path:status`` and, for an error, the start of its message."""
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    began = time.perf_counter()
    response = httpx.post(base + path, content=content, headers=headers, timeout=300)
    took = f" {time.perf_counter() - began:.1f}s"
    if response.status_code == 200:
        return f"{path}:200{took} {len(content) >> 10} KiB"
    message = str(response.json().get("error", {}).get("message", ""))[:80]
    return f"{path}:{response.status_code}{took} {len(content) >> 10} KiB: {message}"


def victim_stream(base: str, stop: threading.Event, gaps: list[tuple[float, float]]) -> None:
    """Stream completions as the victim tenant until ``stop``; (time, gap) per chunk."""
    body = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEYS['victim']}"}
    with httpx.Client(base_url=base, timeout=60, headers=headers) as http:
        while not stop.is_set() and len(gaps) < 1_000_000:
            with http.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                last = None
                for line in response.iter_lines():
                    now = time.perf_counter()
                    if not line.startswith("data:"):
                        continue
                    if last is not None:
                        gaps.append((now, now - last))
                    last = now
                    if stop.is_set():
                        break


def grammar_cache(base: str) -> dict[str, Any] | None:
    """The engine's compiled-grammar figures from /metrics, None where it has none."""
    text = httpx.get(base + "/metrics", timeout=10).text
    return grammar_figures(text)


def grammar_figures(metrics_text: str) -> dict[str, Any] | None:
    names = {
        "kvgate_grammar_cache_bytes": "bytes",
        "kvgate_grammar_cache_limit_bytes": "limit_bytes",
        "kvgate_grammar_cache_entries": "entries",
        "kvgate_max_grammar_bytes": "spec_limit_bytes",
    }
    found: dict[str, Any] = {}
    for line in metrics_text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            found[names[name]] = int(float(value))
    if not found.get("limit_bytes"):  # not counted by this engine
        return None
    figures = {"resident_mib": round(found["bytes"] / 2**20, 1)}
    figures["limit_mib"] = round(found["limit_bytes"] / 2**20, 1)
    return {"source": "metrics", **figures, **found}


def keys_file(folder: str) -> str:
    path = Path(folder) / "keys"
    lines = [f"{t}: {hashlib.sha256(k.encode()).hexdigest()}" for t, k in KEYS.items()]
    path.write_text("\n".join(lines) + "\n")
    return str(path)
