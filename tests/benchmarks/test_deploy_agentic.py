"""The deployment benchmark's measures on hand-built turns, and its requests' shape."""

import orjson
import pytest

from benchmarks.deploy_agentic import RunResult, Turn, request


def run_of(system_tokens: int, sessions: list[list[tuple[int, int, str]]]) -> RunResult:
    return RunResult("r", system_tokens, [[Turn(*t) for t in s] for s in sessions])


def test_hit_rates_ceiling_and_prefill_on_hand_built_turns() -> None:
    # one session pinned to one process; one spread over two (its 2nd turn missed the history)
    result = run_of(
        100,
        [
            [(120, 0, "a"), (150, 112, "a"), (190, 144, "a")],
            [(110, 96, "b"), (140, 96, "c"), (170, 128, "b")],
        ],
    )
    assert result.hit_rate() == pytest.approx(576 / 880)
    assert result.hit_rate(1) == pytest.approx(480 / 650)
    assert result.ceiling() == pytest.approx((120 + 150 + 110 + 140) / 650)
    # beyond the 100 system tokens: cached 12 + 44 + 0 + 28 of 50 + 90 + 40 + 70
    assert result.session_hit_rate() == pytest.approx(84 / 250)
    assert result.computed_tokens() == 880 - 576
    assert result.processes_per_session() == 1.5


def test_the_cache_key_travels_as_argument_and_header_or_not_at_all() -> None:
    body, headers = request("Hi", 4, "session-1")
    params = orjson.loads(body)["params"]
    assert params["arguments"]["cache_key"] == headers["Mcp-Param-Cache-Key"] == "session-1"
    assert headers["Mcp-Name"] == "generate" and params["name"] == "generate"
    body, headers = request("Hi", 4, None)
    assert "cache_key" not in orjson.loads(body)["params"]["arguments"]
    assert "Mcp-Param-Cache-Key" not in headers
