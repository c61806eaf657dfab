"""kvgate engine servers behind sglang-router (skipped when it is not installed): the router
registers them (its probes find ``/health``, ``/server_info``, ``/model_info``) and calls
through it complete, streamed or not."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.live_server import free_port
from tests.gateway.upstream.processes import Process, peer, running

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
    base = f"http://127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("router") / "router.log"
    command = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
    command += ["--port", base.rsplit(":", 1)[1], "--worker-urls", *(w.base for w in workers)]
    with peer(
        # Its metrics listener defaults to 29000, which another router may hold.
        [*command, "--policy", "cache_aware", "--log-level", "warn"]
        + ["--prometheus-port", str(free_port())],
        log,
        base + "/v1/models",
        60,
    ):
        yield base, log


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
