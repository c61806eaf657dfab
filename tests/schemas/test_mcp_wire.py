import pytest
from jsonschema import ValidationError

from kvgate.schemas.mcp_wire import LEGACY_WIRE, MODERN_WIRE, validate_server_message, wire_for


def test_wire_for_versions() -> None:
    assert wire_for("2026-07-28") == MODERN_WIRE
    assert [wire_for(v) for v in ("2025-11-25", "2025-06-18", "2025-03-26")] == [LEGACY_WIRE] * 3


def test_result_is_checked_against_its_method() -> None:
    good = {
        "jsonrpc": "2.0",
        "id": 1,
        "result": {"resultType": "complete", "tools": [], "ttlMs": 0, "cacheScope": "public"},
    }
    validate_server_message(MODERN_WIRE, good, "tools/list")
    with pytest.raises(ValidationError):
        validate_server_message(
            MODERN_WIRE, {**good, "result": {"resultType": "complete", "tools": []}}, "tools/list"
        )  # no caching hints


def test_notifications_and_errors() -> None:
    progress = {
        "jsonrpc": "2.0",
        "method": "notifications/progress",
        "params": {"progressToken": "t", "progress": 3, "message": "abc"},
    }
    validate_server_message(MODERN_WIRE, progress)
    with pytest.raises(ValidationError):
        validate_server_message(MODERN_WIRE, {**progress, "params": {"progress": 3}})
    validate_server_message(
        LEGACY_WIRE, {"jsonrpc": "2.0", "error": {"code": -32700, "message": "x"}}
    )
    with pytest.raises(ValidationError):
        validate_server_message(LEGACY_WIRE, {"jsonrpc": "2.0", "id": 1, "error": {"code": "x"}})
