"""Trace context from `_meta` continued into request → route → engine spans (OpenTelemetry SDK,
in-memory exporter), and nothing recorded without an SDK."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from kvgate.gateway.ops import tracing
from tests.gateway.live_server import LiveServer
from tests.gateway.wire import call

sdk = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry import trace  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


@pytest.fixture(scope="module")
def exporter() -> Iterator[InMemorySpanExporter]:
    """One SDK provider for the process (OpenTelemetry allows setting it once)."""
    memory = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, sdk.TracerProvider):
        provider = sdk.TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(memory))
    yield memory
    memory.shutdown()  # later tests' spans are dropped, not kept (the provider stays set)


def finished(exporter: InMemorySpanExporter, names: set[str], within_s: float = 5.0) -> dict:
    """The finished spans by name once all of `names` are there (the server ends its request
    span just after the last byte is sent)."""
    deadline = time.monotonic() + within_s
    while True:
        spans = {span.name: span for span in exporter.get_finished_spans()}
        if names <= spans.keys() or time.monotonic() > deadline:
            return spans
        time.sleep(0.01)


def test_without_an_sdk_nothing_is_recorded() -> None:
    if tracing.enabled():
        pytest.skip("an SDK provider is already set in this process")
    with tracing.request_span("tools/list", {}, {"traceparent": TRACEPARENT}, 1, {}) as span:
        assert span is None and tracing.current_ids() == {}


def test_a_tool_call_continues_the_callers_trace(exporter, server: LiveServer) -> None:
    exporter.clear()
    model = server.app.state.mcp.tools.model_name
    arguments = {"prompt": "Trace me", "max_tokens": 4, "temperature": 0, "cache_key": "k1"}
    with httpx.Client(timeout=30) as http:
        result = call(
            http,
            server.url,
            "tools/call",
            {"name": "generate", "arguments": arguments},
            name="generate",
            headers={"Mcp-Param-Cache-Key": "k1"},
            meta={"traceparent": TRACEPARENT, "tracestate": "vendor=1"},
        ).result
    engine_name = f"text_completion {model}"
    spans = finished(exporter, {"tools/call generate", "kvgate.route", engine_name})
    request, route, run = spans["tools/call generate"], spans["kvgate.route"], spans[engine_name]
    assert format(request.context.trace_id, "032x") == TRACE_ID
    assert format(request.parent.span_id, "016x") == PARENT_ID and request.parent.is_remote
    assert request.kind == trace.SpanKind.SERVER
    assert request.context.trace_state.to_header() == "vendor=1"
    assert route.parent.span_id == request.context.span_id
    assert run.parent.span_id == route.context.span_id
    assert {s.context.trace_id for s in (request, route, run)} == {request.context.trace_id}
    structured = result["structuredContent"]
    assert request.attributes["mcp.method.name"] == "tools/call"
    assert request.attributes["gen_ai.tool.name"] == "generate"
    assert route.attributes["kvgate.replica"] == structured["replica"]
    assert route.attributes["kvgate.cached_tokens"] == structured["cached_tokens"]
    assert route.attributes["kvgate.cache_key.set"] is True
    assert run.attributes["gen_ai.operation.name"] == "text_completion"
    assert run.attributes["gen_ai.request.model"] == model
    assert run.attributes["gen_ai.usage.input_tokens"] == structured["prompt_tokens"]
    assert run.attributes["gen_ai.usage.output_tokens"] == structured["completion_tokens"]
    assert run.attributes["gen_ai.response.finish_reasons"] == (structured["finish_reason"],)


def test_no_or_bad_context_starts_a_new_trace(exporter, server: LiveServer) -> None:
    exporter.clear()
    with httpx.Client(timeout=30) as http:
        call(http, server.url, "tools/list", meta={"traceparent": "00-not-a-trace-01"})
        call(http, server.url, "resources/read", {"uri": "kvgate://nope"}, name="kvgate://nope")
    spans = finished(exporter, {"tools/list", "resources/read kvgate://nope"})
    listed, failed = spans["tools/list"], spans["resources/read kvgate://nope"]
    assert listed.parent is None and format(listed.context.trace_id, "032x") != TRACE_ID
    assert failed.status.status_code == trace.StatusCode.ERROR  # the -32602 is recorded


def test_log_ids_inside_a_span_continued_from_the_headers(exporter) -> None:
    """No trace context in ``_meta``: the HTTP request's ``traceparent`` header is the one."""
    with tracing.request_span("ping", {}, {}, 7, {"traceparent": TRACEPARENT}):
        ids = tracing.current_ids()
    assert ids["trace_id"] == TRACE_ID and len(ids["span_id"]) == 16


def test_an_upstream_attempt_is_a_client_child_whose_id_goes_upstream(
    exporter: InMemorySpanExporter,
) -> None:
    """What fleet mode sends upstream as ``traceparent``: the call's trace, the attempt's
    span as the parent."""
    with tracing.request_span(
        "tools/call", {"name": "generate"}, {"traceparent": TRACEPARENT}, 1, {}
    ):
        attempt = tracing.client_span("chat m", tracing.current_span(), {"server.port": 8000})
        headers: dict[str, str] = {}
        tracing.inject(headers, attempt)
        tracing.end(attempt, "connect")
    version, trace_id, parent_id, _ = headers["traceparent"].split("-")
    assert (version, trace_id) == ("00", TRACE_ID)
    assert parent_id == format(attempt.get_span_context().span_id, "016x")
    ended = finished(exporter, {"chat m"})["chat m"]
    assert ended.kind == trace.SpanKind.CLIENT and ended.attributes["error.type"] == "connect"
    untraced: dict[str, str] = {}
    tracing.inject(untraced, None)
    assert untraced == {}
