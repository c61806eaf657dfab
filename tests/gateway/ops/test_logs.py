"""Log setup: JSON lines that parse and carry the request's trace ids; text stays text."""

from __future__ import annotations

import json
import logging

import pytest

from kvgate.gateway.ops import tracing
from kvgate.gateway.ops.logs import JsonFormatter, configure_logging


def record(message: str, *args: object, exc_info: object = None) -> logging.LogRecord:
    return logging.LogRecord("kvgate.test", logging.WARNING, __file__, 1, message, args, exc_info)


def test_a_json_line_has_time_level_logger_message() -> None:
    entry = json.loads(JsonFormatter().format(record("redis %s after %.1f s", "back", 2.0)))
    assert entry["message"] == "redis back after 2.0 s"
    assert (entry["level"], entry["logger"]) == ("WARNING", "kvgate.test")
    assert entry["time"].endswith("+00:00")
    assert "trace_id" not in entry or tracing.enabled()


def test_exceptions_are_one_json_field() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import sys

        line = JsonFormatter().format(record("failed", exc_info=sys.exc_info()))
    assert "\n" not in line
    assert json.loads(line)["exception"].endswith("RuntimeError: boom")


def test_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="text, json"):
        configure_logging("xml")
