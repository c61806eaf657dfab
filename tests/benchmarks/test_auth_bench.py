"""The auth benchmark runs and reports every case (timings are its job, not this test's)."""

from __future__ import annotations

import pytest

from benchmarks.auth import main


async def test_every_case_is_reported(capsys: pytest.CaptureFixture[str]) -> None:
    await main(20)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0] for line in lines[1:]] == [
        "auth off",
        "API key (100 tenants)",
        "JWT RS256 reused",
        "JWT ES256 reused",
        "JWT RS256 new each",
        "JWT ES256 new each",
    ]
