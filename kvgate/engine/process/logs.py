"""Log lines: readable text, or one JSON object per line for log collectors.

The engine process writes its lines to the same stderr as the API processes
(``kvgate.gateway.ops.logs`` adds trace ids to these), so both use one format.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import Any

import orjson

TEXT_FORMAT = "%(asctime)s %(name)s %(message)s"
FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    def fields(self) -> dict[str, Any]:
        """Keys a subclass adds to every line."""
        return {}

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **self.fields(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(
    log_format: str = "text",
    level: int = logging.INFO,
    json_formatter: type[JsonFormatter] = JsonFormatter,
) -> None:
    """Route every logger to stderr in ``log_format``."""
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {log_format!r}")
    handler = logging.StreamHandler()
    handler.setFormatter(
        json_formatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    logging.basicConfig(level=level, handlers=[handler], force=True)
