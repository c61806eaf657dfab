"""Send the gateway's spans to an OpenTelemetry collector: ``--otlp-traces-endpoint URL``.

OTLP over HTTP with protobuf bodies (the ``otel`` extra: the SDK and its HTTP exporter, no
gRPC stack). Spans leave in batches from a background thread, so a call never waits on the
collector; the SDK's ``OTEL_BSP_*`` variables tune the batches (``OTEL_BSP_SCHEDULE_DELAY``:
milliseconds between sends) and ``OTEL_SERVICE_NAME`` renames the service (default
``kvgate``). Each process sets up its own exporter (``--workers N``: after the fork).
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

TRACES_PATH = "/v1/traces"  # the collector's OTLP/HTTP path for spans
INSTALL = "pip install 'kvgate[otel]'"


def check_installed() -> None:
    """ValueError, saying what to install, unless the SDK and its exporter import."""
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise ValueError(
            f"--otlp-traces-endpoint needs the otel extra ({exc.name} is missing): {INSTALL}"
        ) from None


def traces_url(endpoint: str) -> str:
    """The URL spans are posted to: ``endpoint`` as given, or with ``/v1/traces`` when it names
    only the collector (``http://collector:4318``), as ``OTEL_EXPORTER_OTLP_ENDPOINT`` does."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint must be an http(s) URL, not {endpoint!r}")
    return endpoint.rstrip("/") + TRACES_PATH if parts.path in ("", "/") else endpoint


def export_traces(endpoint: str) -> None:
    """Make an SDK tracer provider, batching to ``endpoint``, this process's: from now on
    ``kvgate.gateway.ops.tracing`` records every call."""
    check_installed()
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    service = os.environ.get("OTEL_SERVICE_NAME") or "kvgate"
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(traces_url(endpoint))))
    trace.set_tracer_provider(provider)  # its exit hook sends what is still batched
