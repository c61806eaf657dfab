"""OpenTelemetry spans for every call, continuing the caller's trace (GenAI conventions).

A call is one SERVER span. An MCP request continues the W3C trace context its ``_meta``
carries (``traceparent``, ``tracestate``, ``baggage``; basic/index.mdx), else its HTTP
headers'; an OpenAI call, its headers'. The span gathers the GenAI semantic-convention
attributes of its generations (``gen_ai.request.*``, ``gen_ai.usage.*``,
``gen_ai.response.finish_reasons``: ``counted``) and ends in error when the call fails. The
embedded engine adds children for the routing of a generation and for its run; a fleet, one
CLIENT child per upstream attempt (``client_span``), whose context goes upstream (``inject``).

Tracing is on once an SDK tracer provider is set: by ``--otlp-traces-endpoint``
(``kvgate.gateway.ops.otlp``) or by ``opentelemetry-instrument``. This module never imports
OpenTelemetry itself: until something has, ``enabled`` is one dictionary lookup and the
``otel`` extra costs nothing at import.

Child spans are started and ended explicitly, never made "current": tool calls run inside
async generators, where attaching a context on one step and detaching it on another is unsafe.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncGenerator, Iterator, Mapping
from contextlib import aclosing
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from kvgate.gateway.generation import Completion, GenerationRequest, Stream, TextDelta

TRACER_NAME = "kvgate"
CONTEXT_KEYS = ("traceparent", "tracestate", "baggage")
Span = Any  # opentelemetry.trace.Span when installed


def _api() -> Any:
    """``opentelemetry.trace`` once something imported it (the SDK's setup did), else None."""
    return sys.modules.get("opentelemetry.trace")


def enabled() -> bool:
    """True once an SDK tracer provider is set; the API alone would only make no-op spans."""
    trace = _api()
    if trace is None:
        return False
    provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


@dataclass
class CallSpan:
    """A call's SERVER span and the GenAI figures its generations add up to (``n`` > 1)."""

    span: Span
    input_tokens: int = 0
    output_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)

    def add(self, done: Completion) -> None:
        self.input_tokens += done.prompt_tokens
        self.output_tokens += done.completion_tokens
        self.finish_reasons.append(done.finish_reason)
        self.span.set_attributes(
            {
                "gen_ai.usage.input_tokens": self.input_tokens,
                "gen_ai.usage.output_tokens": self.output_tokens,
                "gen_ai.response.finish_reasons": self.finish_reasons,
            }
        )


_call: ContextVar[CallSpan | None] = ContextVar("kvgate_call_span", default=None)


@contextlib.contextmanager
def server_span(
    name: str, carrier: Mapping[str, Any], attributes: Mapping[str, Any]
) -> Iterator[CallSpan | None]:
    """The current SERVER span of one call, a child of the span ``carrier`` names (W3C trace
    context keys: ``_meta`` or the headers) if any. An exception out of it marks it failed."""
    if not enabled():
        yield None
        return
    from opentelemetry import propagate, trace

    context = {key: value for key in CONTEXT_KEYS if isinstance(value := carrier.get(key), str)}
    with trace.get_tracer(TRACER_NAME).start_as_current_span(
        name,
        context=propagate.extract(context),
        kind=trace.SpanKind.SERVER,
        attributes=attributes,
    ) as span:
        call = CallSpan(span)
        reset = _call.set(call)
        try:
            yield call
        except BaseException as exc:  # the SDK records it and the status; this names its kind
            span.set_attribute("error.type", type(exc).__name__)
            raise
        finally:
            _call.reset(reset)


def request_span(
    method: str,
    params: Mapping[str, Any],
    meta: Mapping[str, Any],
    request_id: Any,
    headers: Mapping[str, str],
) -> contextlib.AbstractContextManager[CallSpan | None]:
    """An MCP request's SERVER span, named ``{method} {target}`` (the MCP semantic
    conventions); the caller's trace from ``_meta``, else from the HTTP headers."""
    target = params.get("uri") if method == "resources/read" else params.get("name")
    target = target if isinstance(target, str) else None
    attributes = {"mcp.method.name": method, "jsonrpc.request.id": str(request_id)}
    if method == "tools/call":
        attributes["gen_ai.operation.name"] = "execute_tool"
    if target is not None:
        attributes["gen_ai.tool.name" if method == "tools/call" else "mcp.target"] = target
    carrier = meta if any(key in meta for key in CONTEXT_KEYS) else headers
    return server_span(f"{method} {target}" if target else method, carrier, attributes)


def describe(operation: str, model: str, response_id: str | None = None) -> None:
    """Name the current call's span after its GenAI operation (``chat {model}``), with the
    model asked for and the id its answer carries."""
    call = _call.get()
    if call is None:
        return
    call.span.update_name(f"{operation} {model}")
    attributes = {"gen_ai.operation.name": operation, "gen_ai.request.model": model}
    if response_id is not None:
        attributes["gen_ai.response.id"] = response_id
    call.span.set_attributes(attributes)


def counted(items: Stream, request: GenerationRequest) -> Stream:
    """``items`` passed on, their completions' usage and finish reasons added to the current
    call's span, with what the request asked; ``items`` alone when tracing is off."""
    call = _call.get()
    if call is None:
        return items
    params = request.params
    call.span.set_attributes(
        {
            "gen_ai.request.max_tokens": params.max_tokens,
            "gen_ai.request.temperature": params.temperature,
        }
    )
    return _counted(items, call)


async def _counted(items: Stream, call: CallSpan) -> AsyncGenerator[TextDelta | Completion]:
    async with aclosing(items):
        async for item in items:
            if isinstance(item, Completion):
                call.add(item)
            yield item


def count_input(tokens: int) -> None:
    """An embeddings call's input tokens on its span."""
    call = _call.get()
    if call is not None:
        call.input_tokens += tokens
        call.span.set_attribute("gen_ai.usage.input_tokens", call.input_tokens)


@contextlib.contextmanager
def span(name: str, parent: Span | None = None, **attributes: Any) -> Iterator[Span | None]:
    """A child of ``parent`` (else of the current span), ended on exit; errors are recorded."""
    if not enabled():
        yield None
        return
    from opentelemetry import trace

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


def current_span() -> Span | None:
    """The span current here (a call's SERVER span), to parent children made elsewhere."""
    if not enabled():
        return None
    from opentelemetry import trace

    return trace.get_current_span()


def client_span(name: str, parent: Span | None, attributes: Mapping[str, Any]) -> Span | None:
    """A CLIENT child of ``parent``, started, never current: it ends (``end``) on another
    step of the stream it belongs to."""
    if parent is None:
        return None
    from opentelemetry import trace

    return trace.get_tracer(TRACER_NAME).start_span(
        name,
        context=trace.set_span_in_context(parent),
        kind=trace.SpanKind.CLIENT,
        attributes=attributes,
    )


def end(target: Span | None, error_type: str | None = None) -> None:
    """End ``target``; with ``error_type`` in error, that named as its ``error.type``."""
    if target is None:
        return
    if error_type is not None:
        from opentelemetry import trace

        target.set_attribute("error.type", error_type)
        target.set_status(trace.StatusCode.ERROR, error_type)
    target.end()


def inject(headers: dict[str, str], parent: Span | None) -> None:
    """Add ``parent``'s trace context (``traceparent``, ``tracestate``) to outgoing headers,
    so that the receiver's span is its child; nothing without one."""
    if parent is None:
        return
    from opentelemetry import propagate, trace

    propagate.inject(headers, context=trace.set_span_in_context(parent))


def current_ids() -> dict[str, str]:
    """The current trace and span ids (hex), for log lines; empty outside a span."""
    trace = _api()
    if trace is None:
        return {}
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return {}
    return {
        "trace_id": format(context.trace_id, "032x"),
        "span_id": format(context.span_id, "016x"),
    }
