"""A fleet gateway is a pure proxy: ``kvgate serve --upstream`` serves a call without ever
loading torch (its shared libraries never appear in the process's memory map)."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.gateway.upstream import bad_upstream
from tests.gateway.upstream.processes import Process, gateway, running

TORCH_LIBRARIES = ("libtorch", "libc10")


def mapped_libraries(pid: int) -> set[str]:
    """The file names of the shared objects mapped into process ``pid``."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {Path(line.split()[-1]).name for line in lines if ".so" in line}


def test_a_fleet_gateway_never_loads_torch(tmp_path: Path) -> None:
    upstream = Process(tmp_path, command=("-m", "tests.gateway.upstream.bad_upstream"))
    with running([upstream]):
        fleet = gateway(tmp_path, [upstream])
        with running([fleet]):
            body = {
                "model": bad_upstream.MODEL,
                "messages": [{"role": "user", "content": "good"}],
                "max_tokens": 8,
            }
            answer = httpx.post(fleet.base + "/v1/chat/completions", json=body, timeout=30)
            assert answer.status_code == 200, answer.text
            assert fleet.process is not None
            libraries = mapped_libraries(fleet.process.pid)
    assert any(name.startswith("libpython") or "orjson" in name for name in libraries)
    loaded = sorted(n for n in libraries if n.startswith(TORCH_LIBRARIES))
    assert not loaded, f"a fleet gateway loaded {loaded}"
