"""OpenTelemetry spans for MCP requests, continuing the caller's trace from ``_meta``.

MCP carries W3C trace context in a request's ``_meta`` (``traceparent``, ``tracestate``,
``baggage``; basic/index.mdx). A request becomes a SERVER span in that trace, with children for
the gateway's routing of a generation and for the engine's run of it (GenAI semantic-convention
attributes). ``opentelemetry-api`` is optional (the ``otel`` extra): without it, or without an
SDK tracer provider configured, nothing is recorded and the hot path pays one check.

Child spans are started and ended explicitly, never made "current": tool calls run inside
async generators, where attaching a context on one step and detaching it on another is unsafe.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

try:
    from opentelemetry import propagate, trace
except ImportError:  # the otel extra is not installed: tracing is off
    trace = None  # type: ignore[assignment]

TRACER_NAME = "kvgate"
CONTEXT_KEYS = ("traceparent", "tracestate", "baggage")
Span = Any  # opentelemetry.trace.Span when installed


def enabled() -> bool:
    """True once an SDK tracer provider is set; the API alone would only make no-op spans."""
    if trace is None:
        return False
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


@contextlib.contextmanager
def request_span(
    method: str, params: Mapping[str, Any], meta: Mapping[str, Any], request_id: Any
) -> Iterator[Span | None]:
    """The current SERVER span for one MCP request, a child of the caller's span if ``meta``
    carries one; named ``{method} {target}`` (the MCP semantic conventions)."""
    if not enabled():
        yield None
        return
    carrier = {key: value for key in CONTEXT_KEYS if isinstance(value := meta.get(key), str)}
    target = params.get("uri") if method == "resources/read" else params.get("name")
    target = target if isinstance(target, str) else None
    attributes = {"mcp.method.name": method, "jsonrpc.request.id": str(request_id)}
    if target is not None:
        attributes["gen_ai.tool.name" if method == "tools/call" else "mcp.target"] = target
    tracer = trace.get_tracer(TRACER_NAME)
    with tracer.start_as_current_span(
        f"{method} {target}" if target else method,
        context=propagate.extract(carrier),
        kind=trace.SpanKind.SERVER,
        attributes=attributes,
    ) as span:
        yield span


@contextlib.contextmanager
def span(name: str, parent: Span | None = None, **attributes: Any) -> Iterator[Span | None]:
    """A child of ``parent`` (else of the current span), ended on exit; errors are recorded."""
    if not enabled():
        yield None
        return
    context = trace.set_span_in_context(parent) if parent is not None else None
    child = trace.get_tracer(TRACER_NAME).start_span(name, context=context, attributes=attributes)
    try:
        yield child
    except BaseException as exc:
        child.record_exception(exc)
        child.set_status(trace.StatusCode.ERROR, type(exc).__name__)
        raise
    finally:
        child.end()


def annotate(target: Span | None, **attributes: Any) -> None:
    if target is not None:
        target.set_attributes(attributes)


def inject(headers: dict[str, str]) -> None:
    """Add the current trace context (``traceparent``, ``tracestate``) to outgoing headers."""
    if enabled():
        propagate.inject(headers)


def current_ids() -> dict[str, str]:
    """The current trace and span ids (hex), for log lines; empty outside a span."""
    if trace is None:
        return {}
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return {}
    return {
        "trace_id": format(context.trace_id, "032x"),
        "span_id": format(context.span_id, "016x"),
    }
