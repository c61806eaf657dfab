"""Log setup: readable lines, or one JSON object per line for log collectors.

A JSON line carries the trace and span ids of the request it was logged in (when
OpenTelemetry is active), so logs and traces join up.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime

import orjson

from gateway.ops import tracing

TEXT_FORMAT = "%(asctime)s %(name)s %(message)s"
FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **tracing.current_ids(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(log_format: str = "text", level: int = logging.INFO) -> None:
    """Route every logger (uvicorn's too, when it is told not to set up its own) to stderr."""
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    logging.basicConfig(level=level, handlers=[handler], force=True)
