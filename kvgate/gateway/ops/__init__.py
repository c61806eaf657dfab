"""Operating the gateway: Prometheus metrics, OpenTelemetry tracing, structured logs."""
