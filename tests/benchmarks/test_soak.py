"""The CI-sized soak: ~40 s of mixed traffic with cancellations and over-limit calls through
a live kvgate, then the audit (every answer well formed with an intended status, the block
pool consistent, nothing held)."""

import pytest

from benchmarks.soak import parse_args, run_soak


@pytest.mark.timeout(180)
def test_soak_leaves_nothing_behind():
    report = run_soak(parse_args(["--duration", "40", "--concurrency", "24"]))
    outcomes = report["outcomes"]
    assert report["problems"] == [], report["problems"]
    assert set(report["statuses"]) <= {"200", "429", "503"}
    assert outcomes["completed"] > 50 and outcomes["cancelled"] > 10
    assert outcomes["over_limit_tool_error"] > 0 and outcomes.get("rejected_429", 0) > 0
    assert report["engine_idle"] and report["blocks_in_use"] == 0 and report["invariants"] == "ok"
    assert report["passed"]
