"""The official MCP conformance suite's generic server scenarios, both wires, against
`kvgate serve` started as users start it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.gateway.live_server import free_port
from tests.gateway.mcp import conformance

# Another runner (a script printing "N passed, M failed" last) may be named instead.
RUNNER = os.environ.get("KVGATE_CONFORMANCE_RUNNER")


@pytest.fixture(scope="module")
def kvgate_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "KVGATE_KV_CACHE_MEMORY": "16MiB"}
    log_path = tmp_path_factory.mktemp("conformance") / "kvgate.log"
    log = log_path.open("wb")  # a file, not a pipe nobody drains
    process = subprocess.Popen(
        [sys.executable, "-m", "kvgate", "serve", "--port", str(port), "--model", "tiny"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"kvgate serve exited: {log_path.read_text()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("kvgate serve did not become ready")
            time.sleep(0.2)
        yield f"http://localhost:{port}/mcp"
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_generic_server_scenarios_pass_on_both_wires(kvgate_url: str) -> None:
    if RUNNER:
        run = subprocess.run(
            ["bash", RUNNER, kvgate_url], capture_output=True, text=True, timeout=840
        )
        lines = run.stdout.strip().splitlines()
        assert lines and lines[-1].endswith(" passed, 0 failed"), run.stdout + run.stderr
        return
    try:
        results = conformance.run_suite(kvgate_url)
    except conformance.SetupError as exc:
        pytest.skip(f"the conformance suite cannot be installed here: {exc}")
    report = "\n".join(r.line() for r in results)
    assert len(results) == len(conformance.GENERIC_SCENARIOS) == 18
    assert all(r.passed for r in results), report
