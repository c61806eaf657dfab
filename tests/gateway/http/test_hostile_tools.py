"""A chat whose ``tools`` carry large JSON Schemas: checking them (jsonschema's meta-schema
walk, seconds for 1 MiB) ran on the event loop, through both doors, and stalled /healthz and
every other client's stream for as long (issue 27). Now a large body's tools, like its
prompt, are read on the bounded prepare pool."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from kvgate.engine import AsyncLLM
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.stats import EngineStats
from kvgate.gateway.function_calls.functions import Functions
from kvgate.gateway.generation import OFF_LOOP_CHARS, GenerationRequest, prompt_chars
from tests.gateway.live_server import LiveServer
from tests.gateway.wire import modern_headers, modern_meta

TOOLS = 64


@pytest.fixture(scope="module")
def live(engine: AsyncLLM) -> Iterator[LiveServer]:
    with LiveServer(engine, keepalive_s=0.2) as server:  # the default 1 MiB body limit
        yield server


def heavy_tools(total_bytes: int) -> list[dict[str, Any]]:
    """``TOOLS`` tools of nested object properties, ~``total_bytes`` of JSON; the last one's
    schema is invalid, so the call is refused only once every schema has been checked."""
    field = {
        "type": "object",
        "description": "a field",
        "properties": {f"a{k}": {"type": "string", "enum": ["x", "y"]} for k in range(3)},
        "required": ["a0"],
    }
    per_tool = max(1, total_bytes // TOOLS // len(orjson.dumps(field)))
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "parameters": {
                    "type": "object",
                    "properties": {f"p{j}": field for j in range(per_tool)},
                },
            },
        }
        for i in range(TOOLS)
    ]
    tools[-1]["function"]["parameters"] = {"type": "object", "properties": {"n": {"minLength": -1}}}
    return tools


def openai_call(live: LiveServer, tools: list[dict[str, Any]]) -> tuple[int, str]:
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 1}
    with httpx.Client(timeout=60) as http:
        response = http.post(
            live.base + "/v1/chat/completions",
            content=orjson.dumps(body),
            headers={"Content-Type": "application/json"},
        )
    return response.status_code, str(response.json()["error"]["param"])


def mcp_call(live: LiveServer, tools: list[dict[str, Any]]) -> tuple[int, str]:
    arguments = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 1}
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "tools/call",
        "params": {"name": "chat", "arguments": arguments, "_meta": modern_meta()},
    }
    headers = modern_headers("tools/call", "chat")
    with httpx.Client(timeout=60) as http:
        response = http.post(live.url, content=orjson.dumps(body), headers=headers)
    result = response.json()["result"]
    assert result["isError"] is True
    return response.status_code, result["content"][0]["text"]


@pytest.mark.parametrize("door", [openai_call, mcp_call], ids=["openai", "mcp"])
def test_large_tool_schemas_are_checked_off_the_event_loop(
    live: LiveServer, door: Callable[[LiveServer, list[dict[str, Any]]], tuple[int, str]]
) -> None:
    """~800 KB of schemas took the checker 1-2 s on the loop (/healthz waited as long);
    now /healthz answers within 0.4 s throughout, and the bad schema is still named."""
    tools = heavy_tools(800_000)
    answers: list[tuple[int, str]] = []
    worker = threading.Thread(target=lambda: answers.append(door(live, tools)))
    slowest, probes = 0.0, 0
    with httpx.Client(base_url=live.base, timeout=10) as http:
        http.get("/healthz")
        worker.start()
        while worker.is_alive() and probes < 2000:
            began = time.monotonic()
            assert http.get("/healthz").status_code == 200
            slowest = max(slowest, time.monotonic() - began)
            probes += 1
            time.sleep(0.01)
        worker.join(timeout=60)
    status, said = answers[0]
    assert f"tools[{TOOLS - 1}].function.parameters" in said
    assert status == (400 if door is openai_call else 200)
    assert slowest < 0.4, f"/healthz waited {slowest:.2f} s"


def gauges(live: LiveServer) -> dict[str, float]:
    text = httpx.get(live.base + "/metrics", timeout=10).text
    pairs = (line.split(" ", 1) for line in text.splitlines() if line.startswith("kvgate_"))
    return {name: float(value) for name, value in pairs if "grammar" in name}


def test_the_grammar_cache_s_memory_is_on_metrics_against_its_bound(live: LiveServer) -> None:
    """What ``benchmarks.hostile`` prints: the compiled grammars' bytes and their bound."""
    body = {"prompt": "Pick:", "max_tokens": 1, "structured_outputs": {"choice": ["ab", "cd"]}}
    answer = httpx.post(live.base + "/v1/completions", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    found = gauges(live)
    names = {"bytes", "limit_bytes", "entries"}
    assert {f"kvgate_grammar_cache_{n}" for n in names} | {"kvgate_max_grammar_bytes"} <= set(found)
    fields = {f.name for f in dataclasses.fields(EngineStats)}
    if "grammar_cache_limit_bytes" in fields:  # the engine counts them
        limit, held = found["kvgate_grammar_cache_limit_bytes"], found["kvgate_grammar_cache_bytes"]
        assert 0 < held <= limit and found["kvgate_grammar_cache_entries"] >= 1


def test_a_chat_s_tools_count_toward_templating_it_on_a_worker() -> None:
    """Small messages with 1 MiB of tools were templated on the loop (the chat template walks
    and renders every tool: one ~250 ms pause per body); the tools now count in its size."""
    tools = heavy_tools(100_000)[:-1]
    functions = Functions.of(tools, None, None)
    assert functions is not None and functions.chars > 90_000
    request = GenerationRequest(
        SamplingParams(), messages=[{"role": "user", "content": "hi"}], functions=functions
    )
    assert prompt_chars(request) > OFF_LOOP_CHARS
