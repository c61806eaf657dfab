"""Log setup: the engine's formats (``kvgate.engine.process.logs``), a JSON line carrying the trace and span
ids of the request it was logged in (when OpenTelemetry is active), so logs and traces join up.
"""

from __future__ import annotations

import logging
from typing import Any

from kvgate.engine.process import logs
from kvgate.gateway.ops import tracing


class JsonFormatter(logs.JsonFormatter):
    def fields(self) -> dict[str, Any]:
        return tracing.current_ids()


def configure_logging(log_format: str = "text", level: int = logging.INFO) -> None:
    """Route every logger (uvicorn's too, when it is told not to set up its own) to stderr."""
    logs.configure_logging(log_format, level, JsonFormatter)
