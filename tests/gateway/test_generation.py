"""A prompt, or a text to tokenize, that cannot fit in max_model_len tokens is refused at
both front doors before the tokenizer sees it (``kvgate.gateway.generation``, over the engine's
``encode_prompt`` and ``Tokenizer.min_tokens``): the MCP tools answer a tool error, the
OpenAI routes a 400, each saying how many tokens it is at least and what the limit is.

``EngineBackend.start`` also compiles a request's grammar on a worker thread before admitting
it, so a large schema (or the first, which builds the vocabulary tables) never stalls the
event loop; a schema seen before is not compiled again."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvgate.engine import AsyncLLM, SamplingParams, StructuredOutputs
from kvgate.gateway.embedded import EngineBackend
from kvgate.gateway.generation import (
    HUGE_CHARS,
    OFF_LOOP_CHARS,
    Completion,
    GenerationRequest,
    OffLoop,
)
from tests.engine.tokenization.test_tokenizer import CountingBackend
from tests.gateway.live_server import LiveServer
from tests.gateway.mcp.test_tool_runner import run_tool

# 50,000 bytes: over 4,095 prompt tokens x 12 bytes (the tiny vocabulary's longest token),
# under the test server's 64 KiB body limit.
TOO_LONG = "word " * 10_000


@pytest.fixture
def counting(engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> Iterator[CountingBackend]:
    assert engine.max_model_len == 4096 and engine.tokenizer.max_token_bytes == 12
    backend = CountingBackend(engine.tokenizer.backend)
    monkeypatch.setattr(engine.tokenizer, "backend", backend)
    yield backend
    assert engine.stats().num_running == 0 and engine.stats().num_waiting == 0


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as client:
        yield client


NO_ROOM = "prompt: at least 4167 tokens leave no room to generate within max_model_len 4096"


@pytest.mark.parametrize(
    ("tool", "arguments", "says"),
    [
        ("generate", {"prompt": TOO_LONG, "max_tokens": 1}, NO_ROOM),
        (
            "chat",  # the rendered conversation is measured: 53 bytes of template more
            {"messages": [{"role": "user", "content": TOO_LONG}], "max_tokens": 1},
            "prompt: at least 4172 tokens leave no room to generate within max_model_len 4096",
        ),
        (
            "tokenize",
            {"text": TOO_LONG},
            "text: at least 4167 tokens (a token stands for at most 12 bytes), more than 4096 "
            "(max_model_len)",
        ),
    ],
)
def test_mcp_tools_refuse_it_without_tokenizing(
    http: httpx.Client,
    server: LiveServer,
    counting: CountingBackend,
    tool: str,
    arguments: dict[str, Any],
    says: str,
) -> None:
    result = run_tool(http, server, tool, arguments)
    assert result["isError"] is True
    assert result["content"][0]["text"] == f"Invalid arguments for tool '{tool}': {says}"
    assert counting.calls == 0


@pytest.mark.parametrize(
    ("path", "body", "param", "says"),
    [
        ("/v1/completions", {"prompt": TOO_LONG, "max_tokens": 1}, None, NO_ROOM),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": TOO_LONG}], "max_tokens": 1},
            None,
            "prompt: at least 4172 tokens",
        ),
        ("/tokenize", {"prompt": TOO_LONG}, "prompt", "text: at least 4167 tokens"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": TOO_LONG}]},
            "messages",
            "messages: at least 4172 tokens",
        ),
    ],
)
def test_openai_routes_refuse_it_without_tokenizing(
    http: httpx.Client,
    server: LiveServer,
    counting: CountingBackend,
    path: str,
    body: dict[str, Any],
    param: str | None,
    says: str,
) -> None:
    response = http.post(server.base + path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"].startswith(says) and "4096" in error["message"]
    assert counting.calls == 0


def test_a_long_text_that_may_fit_is_tokenized(
    http: httpx.Client, server: LiveServer, counting: CountingBackend, engine: AsyncLLM
) -> None:
    """The floor only refuses what cannot fit: under it, the exact count decides."""
    text = "word " * 9_000  # 45,000 bytes: at least 3,750 tokens, so it is counted
    out = http.post(server.base + "/tokenize", json={"prompt": text}).json()
    assert out["count"] == len(counting.backend.encode(text).ids) > 4096  # type: ignore[attr-defined]
    assert counting.calls == 1
    result = run_tool(http, server, "generate", {"prompt": text, "max_tokens": 1})
    assert result["isError"] is True and f"prompt: {out['count']} tokens" in str(result)


def test_grammars_compile_off_the_event_loop(
    engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[str] = []
    compile_grammar = engine.compile_grammar

    def recording(spec: StructuredOutputs) -> None:
        threads.append(threading.current_thread().name)
        compile_grammar(spec)

    monkeypatch.setattr(engine, "compile_grammar", recording)
    properties = {f"field_{i}": {"type": "integer", "maximum": i} for i in range(40)}
    spec = StructuredOutputs(json={"type": "object", "properties": properties})
    params = SamplingParams(max_tokens=4, temperature=0, structured_outputs=spec)

    async def run() -> str:
        backend = EngineBackend(engine)
        try:
            for _ in range(2):
                stream = await backend.start(GenerationRequest(params, prompt="Hi"))
                items = [item async for item in stream]
            assert isinstance(items[-1], Completion)
            return threading.current_thread().name
        finally:
            await backend.aclose()

    loop_thread = asyncio.run(run())
    assert len(threads) == 1  # the second request found it compiled
    assert threads[0].startswith("kvgate-prepare") and threads[0] != loop_thread


def test_a_bad_schema_is_refused_before_anything_is_queued(engine: AsyncLLM) -> None:
    spec = StructuredOutputs(json={"type": "object", "not": {}})
    params = SamplingParams(max_tokens=4, structured_outputs=spec)

    async def run() -> None:
        backend = EngineBackend(engine)
        try:
            with pytest.raises(ValueError, match="structured_outputs.json/not"):
                await backend.start(GenerationRequest(params, prompt="Hi"))
        finally:
            await backend.aclose()

    asyncio.run(run())
    assert engine.stats().num_waiting == 0


async def test_huge_preparations_take_turns_on_a_thread_of_their_own() -> None:
    """Work on bodies past HUGE_CHARS runs one at a time (two at once fought the event loop for
    the GIL), and ordinary large work never waits behind it."""
    off_loop, release = OffLoop(), threading.Event()
    running, most = [0], [0]

    def huge() -> None:
        running[0] += 1
        most[0] = max(most[0], running[0])
        release.wait(5)
        running[0] -= 1

    try:
        held = [asyncio.ensure_future(off_loop.run(HUGE_CHARS + 1, huge)) for _ in range(2)]
        ordinary = await asyncio.wait_for(off_loop.run(OFF_LOOP_CHARS + 1, lambda: "ok"), 2)
        release.set()
        await asyncio.gather(*held)
    finally:
        release.set()
        off_loop.close()
    assert ordinary == "ok" and most[0] == 1
