"""``kvgate serve --otlp-traces-endpoint`` against a real OTLP/HTTP receiver: a collector's
``POST /v1/traces`` on loopback, its bodies parsed with ``opentelemetry-proto``'s own classes.
An OpenAI call and an MCP ``tools/call`` each arrive as one SERVER span with the GenAI
attributes, in the trace the client's ``traceparent`` names; a refused call's span is an
error; without the extra the flag is refused before a model loads."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.otlp_receiver import (
    PARENT_ID,
    Receiver,
    Span,
    Status,
    receiving,
    traceparent,
)
from tests.gateway.upstream.processes import REPO_ROOT, Process
from tests.gateway.wire import call


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with receiving() as started:
        yield started


@pytest.fixture(scope="module")
def kvgate(receiver: Receiver, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """``kvgate serve`` (the tiny model in its process) exporting every 50 ms."""
    process = Process(
        tmp_path_factory.mktemp("otlp"),
        "--in-process-engine",
        "--otlp-traces-endpoint",
        receiver.url,
        env={"OTEL_BSP_SCHEDULE_DELAY": "50"},
    )
    try:
        yield process.start().wait_ready()
    finally:
        process.stop()


def model_of(base: str) -> str:
    return httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_a_chat_call_is_one_server_span_with_the_genai_attributes(
    receiver: Receiver, kvgate: Process
) -> None:
    model = model_of(kvgate.base)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Trace this chat"}],
        "max_tokens": 5,
        "temperature": 0,
    }
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"traceparent": traceparent(trace_id)}
    answer = httpx.post(kvgate.base + "/v1/chat/completions", json=body, headers=headers).json()
    (span,) = receiver.wait(lambda s: s.attributes.get("gen_ai.response.id") == answer["id"])
    assert span.span.name == f"chat {model}" and span.span.kind == Span.SPAN_KIND_SERVER
    assert span.trace_id == trace_id and span.span.parent_span_id.hex() == PARENT_ID
    assert span.service == "kvgate"
    usage = answer["usage"]
    assert span.attributes == span.attributes | {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": 5,
        "gen_ai.request.temperature": 0.0,
        "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "gen_ai.response.finish_reasons": [answer["choices"][0]["finish_reason"]],
        "http.route": "/v1/chat/completions",
    }
    assert span.span.status.code != Status.STATUS_CODE_ERROR


def test_a_streamed_completion_counts_its_tokens_too(receiver: Receiver, kvgate: Process) -> None:
    model = model_of(kvgate.base)
    body = {"model": model, "prompt": "Once", "max_tokens": 4, "stream": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", kvgate.base + "/v1/completions", json=body, timeout=30) as stream:
        lines = [line for line in stream.iter_lines() if line.startswith("data: {")]
    usage = httpx.Response(200, content=lines[-1][6:]).json()
    (span,) = receiver.wait(lambda s: s.attributes.get("gen_ai.response.id") == usage["id"])
    assert span.span.name == f"text_completion {model}"
    assert span.attributes["gen_ai.usage.output_tokens"] == usage["usage"]["completion_tokens"] > 0


def test_an_mcp_tool_call_is_a_span_in_the_callers_trace(
    receiver: Receiver, kvgate: Process
) -> None:
    trace_id = "11111111111111111111111111111111"
    arguments = {"prompt": "Trace this tool", "max_tokens": 3, "temperature": 0}
    with httpx.Client(timeout=30) as http:
        result = call(
            http,
            kvgate.base + "/mcp",
            "tools/call",
            {"name": "generate", "arguments": arguments},
            name="generate",
            meta={"traceparent": traceparent(trace_id)},
        ).result
    (server,) = receiver.wait(lambda s: s.trace_id == trace_id and s.span.name.startswith("tools"))
    assert server.span.name == "tools/call generate"
    assert server.span.kind == Span.SPAN_KIND_SERVER
    structured = result["structuredContent"]
    assert server.attributes == server.attributes | {
        "mcp.method.name": "tools/call",
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "generate",
        "gen_ai.request.max_tokens": 3,
        "gen_ai.usage.input_tokens": structured["prompt_tokens"],
        "gen_ai.usage.output_tokens": structured["completion_tokens"],
        "gen_ai.response.finish_reasons": [structured["finish_reason"]],
    }
    (route,) = receiver.wait(lambda s: s.trace_id == trace_id and s.span.name == "kvgate.route")
    assert route.span.parent_span_id == server.span.span_id


def test_a_refused_call_ends_its_span_in_error(receiver: Receiver, kvgate: Process) -> None:
    body = {"model": model_of(kvgate.base), "prompt": "x", "max_tokens": -1}
    trace_id = "22222222222222222222222222222222"
    headers = {"traceparent": traceparent(trace_id)}
    assert (
        httpx.post(kvgate.base + "/v1/completions", json=body, headers=headers).status_code == 400
    )
    (span,) = receiver.wait(lambda s: s.trace_id == trace_id)
    assert span.span.status.code == Status.STATUS_CODE_ERROR
    assert span.attributes["error.type"] == "BadInput"


def test_the_flag_without_the_extra_is_refused_before_loading(tmp_path: Path) -> None:
    """The exporter made unimportable, as in an install without the ``otel`` extra."""
    script = (
        "import sys; sys.modules['opentelemetry.exporter'] = None; "
        "from kvgate.gateway.cli import main; "
        "main(['serve', '--port', '0', '--otlp-traces-endpoint', 'http://127.0.0.1:4318'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "kvgate: --otlp-traces-endpoint needs the otel extra (opentelemetry.exporter.otlp is "
        "missing): pip install 'kvgate[otel]'"
    )


def test_a_collector_address_gets_the_traces_path() -> None:
    from kvgate.gateway.ops.otlp import traces_url

    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://c:4318/v1/traces") == "http://c:4318/v1/traces"
    with pytest.raises(ValueError, match="http"):
        traces_url("collector:4317")
