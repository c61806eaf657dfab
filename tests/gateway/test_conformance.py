"""The official MCP conformance suite's generic server scenarios, both wires, against
`kvgate serve` started as users start it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.live_server import free_port

RUNNER = Path(
    os.environ.get(
        "KVGATE_CONFORMANCE_RUNNER",
        Path(__file__).resolve().parents[3] / "shared" / "tools" / "mcp-conformance" / "run.sh",
    )
)


@pytest.fixture(scope="module")
def kvgate_url() -> Iterator[str]:
    port = free_port()
    env = {**os.environ, "KVGATE_KV_CACHE_MEMORY": "16MiB"}
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"kvgate serve exited: {process.stdout.read()}")
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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_generic_server_scenarios_pass_on_both_wires(kvgate_url: str) -> None:
    assert RUNNER.is_file(), f"conformance runner not found at {RUNNER}"
    run = subprocess.run(
        ["bash", str(RUNNER), kvgate_url], capture_output=True, text=True, timeout=840
    )
    lines = run.stdout.strip().splitlines()
    assert lines and lines[-1] == "18 passed, 0 failed", run.stdout + run.stderr
