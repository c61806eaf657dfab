"""kvgate engine servers behind sglang-router (skipped when it is not installed): the router
registers them (its probes find ``/health``, ``/server_info``, ``/model_info``) and calls
through it complete, streamed or not."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.live_server import free_port
from tests.gateway.upstream.processes import REPO_ROOT, Process, running

pytest.importorskip("sglang_router")
pytestmark = pytest.mark.slow  # two engine servers and a router: tens of seconds
PROBES = ("/health", "/server_info", "/model_info", "/get_server_info", "/get_model_info")


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Process]]:
    log_dir = tmp_path_factory.mktemp("sglang")
    with running([Process(log_dir) for _ in range(2)]) as started:
        yield started


@pytest.fixture(scope="module")
def router(
    workers: list[Process], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Path]]:
    port = free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
            + ["--port", str(port), "--worker-urls", *(w.base for w in workers)]
            + ["--policy", "cache_aware", "--log-level", "warn"],
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, "sglang-router never became ready"
            try:
                if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield base, log
    finally:
        process.terminate()
        process.wait(30)


def test_the_probes_it_sends_are_answered(workers: list[Process]) -> None:
    model = httpx.get(workers[0].base + "/v1/models", timeout=5).json()["data"][0]["id"]
    for path in PROBES:
        answer = httpx.get(workers[0].base + path, timeout=5)
        assert answer.status_code == 200, (path, answer.text)
        if "info" in path:
            assert answer.json()["model_path"] == model


def test_calls_through_it_complete(router: tuple[str, Path], workers: list[Process]) -> None:
    base, log = router
    model = httpx.get(base + "/v1/models", timeout=5).json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for i in range(4):
        plain = httpx.post(base + "/v1/chat/completions", json={**body, "seed": i}, timeout=30)
        assert plain.status_code == 200, plain.text
        assert plain.json()["choices"][0]["finish_reason"] in ("length", "stop")
    with httpx.stream(
        "POST", base + "/v1/chat/completions", json={**body, "stream": True}, timeout=30
    ) as streamed:
        assert streamed.status_code == 200
        assert list(streamed.iter_lines())[-2:] == ["data: [DONE]", ""]
    assert "404" not in log.read_text(errors="replace")
