"""The README's examples (examples/curl/*.sh, examples/sdk_client.py) work against a live kvgate."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvgate.engine import AsyncLLM, EngineConfig
from tests.gateway.live_server import LiveServer

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
needs_curl = pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    engine = AsyncLLM(EngineConfig(kv_cache_memory="16MiB", seed=0))
    try:
        with LiveServer(engine) as live:
            yield live
    finally:
        engine.shutdown()


def curl_example(name: str, server: LiveServer) -> str:
    script = EXAMPLES / "curl" / name
    env = os.environ | {"KVGATE_URL": server.url, "KVGATE_BASE": server.base}
    done = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def result_of(output: str) -> dict[str, Any]:
    response = json.loads(output)
    assert response["id"] == 1 and "error" not in response, response
    return response["result"]


@needs_curl
def test_discover(server: LiveServer) -> None:
    result = result_of(curl_example("discover.sh", server))
    assert "2026-07-28" in result["supportedVersions"]
    assert "tools" in result["capabilities"]


@needs_curl
def test_tools_list(server: LiveServer) -> None:
    names = {tool["name"] for tool in result_of(curl_example("tools_list.sh", server))["tools"]}
    assert {"generate", "chat"} <= names


@needs_curl
def test_generate(server: LiveServer) -> None:
    result = result_of(curl_example("generate.sh", server))
    assert result["isError"] is False
    assert result["structuredContent"]["completion_tokens"] > 0
    assert result["content"][0]["text"] == result["structuredContent"]["text"]


@needs_curl
def test_generate_stream(server: LiveServer) -> None:
    events = [
        json.loads(line.removeprefix("data: "))
        for line in curl_example("generate_stream.sh", server).splitlines()
        if line.startswith("data: ")
    ]
    *progress, final = events
    assert progress and all(e["method"] == "notifications/progress" for e in progress)
    assert [e["params"]["progressToken"] for e in progress] == ["gen-1"] * len(progress)
    assert final["id"] == 1
    streamed = "".join(e["params"]["message"] for e in progress)
    assert streamed == final["result"]["structuredContent"]["text"]


@needs_curl
def test_chat_with_cache_key_header(server: LiveServer) -> None:
    first = result_of(curl_example("chat.sh", server))
    again = result_of(curl_example("chat.sh", server))
    assert first["isError"] is False and first["structuredContent"]["completion_tokens"] > 0
    assert again["structuredContent"]["cached_tokens"] > 0  # same conversation, prefix reused


def test_sdk_client(server: LiveServer) -> None:
    script = EXAMPLES / "sdk_client.py"
    done = subprocess.run(
        [sys.executable, str(script), server.url], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "protocol 2026-07-28" in done.stdout
    assert "tool generate:" in done.stdout
    assert "structured result: {'text': " in done.stdout
    assert "bad arguments -> isError=True" in done.stdout


@needs_curl
def test_openai_chat_with_curl(server: LiveServer) -> None:
    answer = json.loads(curl_example("openai_chat.sh", server))
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"]["role"] == "assistant"
    assert answer["usage"]["completion_tokens"] > 0


@needs_curl
def test_openai_tools_with_curl(server: LiveServer) -> None:
    choice = json.loads(curl_example("openai_tools.sh", server))["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "get_weather"
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")


@needs_curl
def test_openai_stream_with_curl(server: LiveServer) -> None:
    lines = [line for line in curl_example("openai_stream.sh", server).splitlines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    assert all(c["object"] == "text_completion" for c in chunks)


def test_openai_client(server: LiveServer) -> None:
    script = EXAMPLES / "openai_client.py"
    done = subprocess.run(
        [sys.executable, str(script), server.base + "/v1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "model: " in done.stdout and "chat: " in done.stdout and "stream: " in done.stdout


def test_the_examples_extra_installs_what_the_python_examples_import() -> None:
    """``pip install -e '.[examples]'`` (the README's line) brings every package an example
    imports that the plain install does not."""
    import ast
    import tomllib

    project = tomllib.loads((EXAMPLES.parent / "pyproject.toml").read_text())["project"]
    installed = {
        requirement.split("[")[0].split(">")[0].split("=")[0].split(";")[0].strip().lower()
        for requirement in [*project["dependencies"], *project["optional-dependencies"]["examples"]]
    }
    local = {"kvgate"}
    for script in EXAMPLES.glob("*.py"):
        for node in ast.walk(ast.parse(script.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top in local:
                    continue
                assert top in installed, f"{script.name} imports {top}: add it to [examples]"
