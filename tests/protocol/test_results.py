import pytest

from kvgate.protocol.results import cacheable, complete
from kvgate.schemas.mcp_wire import validator

INFO = {"name": "kvgate", "version": "1"}


def test_complete_keeps_existing_meta_and_adds_server_info() -> None:
    shaped = complete({"content": [], "_meta": {"x.y/z": 1}}, INFO)
    assert shaped["resultType"] == "complete"
    assert shaped["_meta"] == {"x.y/z": 1, "io.modelcontextprotocol/serverInfo": INFO}
    validator("2026-07-28", "CallToolResult").validate(shaped)


def test_cacheable_results_validate_and_refuse_negative_ttl() -> None:
    shaped = cacheable({"tools": []}, INFO, 1000, "public")
    validator("2026-07-28", "ListToolsResult").validate(shaped)
    assert (shaped["ttlMs"], shaped["cacheScope"]) == (1000, "public")
    with pytest.raises(ValueError):
        cacheable({"tools": []}, INFO, -1, "private")
