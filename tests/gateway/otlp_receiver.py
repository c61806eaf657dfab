"""A real OTLP/HTTP collector's trace endpoint for the tests: ``POST /v1/traces`` on a free
loopback port, its bodies parsed with ``opentelemetry-proto``'s own classes, each span kept
with its attributes as Python values. Importing it skips a test module without the otel
extra."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue  # noqa: E402
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status  # noqa: E402

__all__ = ["PARENT_ID", "Receiver", "Span", "Status", "receiving", "traceparent"]

PARENT_ID = "00f067aa0ba902b7"


def traceparent(trace_id: str, parent: str = PARENT_ID) -> str:
    return f"00-{trace_id}-{parent}-01"


@dataclass
class Received:
    """One span as the collector got it, its attributes as Python values."""

    span: Span
    service: str
    attributes: dict[str, Any]

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()


def value(any_value: AnyValue) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind)


class Receiver:
    """The trace endpoint of an OTLP/HTTP collector, on a free loopback port."""

    def __init__(self) -> None:
        self.spans: list[Received] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                assert self.path == "/v1/traces"
                assert self.headers["Content-Type"] == "application/x-protobuf"
                receiver.add(ExportTraceServiceRequest.FromString(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, request: ExportTraceServiceRequest) -> None:
        for resource in request.resource_spans:
            service = {a.key: value(a.value) for a in resource.resource.attributes}
            for scope in resource.scope_spans:
                for span in scope.spans:
                    attributes = {a.key: value(a.value) for a in span.attributes}
                    with self.lock:
                        self.spans.append(Received(span, service["service.name"], attributes))

    def wait(self, found: Callable[[Received], bool], count: int = 1) -> list[Received]:
        deadline = time.monotonic() + 10
        while True:
            with self.lock:
                spans = [s for s in self.spans if found(s)]
            if len(spans) >= count or time.monotonic() > deadline:
                assert len(spans) >= count, [s.span.name for s in self.spans]
                return spans
            time.sleep(0.02)


@contextmanager
def receiving() -> Iterator[Receiver]:
    """A receiver answering from a thread of its own until the block ends."""
    receiver = Receiver()
    thread = threading.Thread(target=receiver.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()
        thread.join()
