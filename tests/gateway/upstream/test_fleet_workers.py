"""``--workers N`` in fleet mode, with real processes: N workers on one port route every key
alike (as separate gateways do), answer with ``X-Kvgate-Upstream``, drain on SIGTERM and die
with their parent; ``--workers`` over an in-process engine is refused (over the engine's own
process: ``tests/gateway/test_engine_supervisor.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.gateway.upstream.processes import (
    REPO_ROOT,
    Process,
    alive,
    children,
    gateway,
    mcp_headers,
    running,
    tool_call,
)
from tests.gateway.upstream.recording_upstream import MODEL

RECORDING = ("-m", "tests.gateway.upstream.recording_upstream")
KEYS = [f"session-{i}" for i in range(8)]


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("workers")


@pytest.fixture(scope="module")
def upstreams(log_dir: Path) -> Iterator[list[Process]]:
    with running([Process(log_dir, command=RECORDING) for _ in range(3)], 30) as started:
        yield started


@pytest.fixture(scope="module")
def fronts(log_dir: Path, upstreams: list[Process]) -> Iterator[list[Process]]:
    """Two gateways of two workers each over the same upstreams."""
    with running([gateway(log_dir, upstreams, "--workers", "2") for _ in range(2)], 60) as up:
        yield up


def served_by(base: str, key: str) -> str:
    """The upstream a fresh connection's chat call for ``key`` went to (its header)."""
    with httpx.Client(timeout=10) as client:  # a new connection: any worker may take it
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        response = client.post(base + "/v1/chat/completions", json={**body, "cache_key": key})
    assert response.status_code == 200, response.text
    return response.headers["x-kvgate-upstream"]


def test_workers_and_gateways_route_every_key_alike(
    fronts: list[Process], upstreams: list[Process]
) -> None:
    for front in fronts:
        assert front.process is not None and len(children(front.process.pid)) == 2
    urls = {u.base for u in upstreams}
    for key in KEYS:
        seen = {served_by(front.base, key) for front in fronts for _ in range(4)}
        assert len(seen) == 1 and seen <= urls, (key, seen)


def test_the_upstream_is_named_on_every_answer(
    fronts: list[Process], upstreams: list[Process]
) -> None:
    front = fronts[0]
    urls = {u.base for u in upstreams}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, "stream": True}
    with httpx.stream("POST", front.base + "/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200 and r.headers["x-kvgate-upstream"] in urls
        assert list(r.iter_lines())[-2:] == ["data: [DONE]", ""]
    arguments = {"prompt": "hi", "max_tokens": 1, "cache_key": "k"}
    mcp = httpx.post(
        front.base + "/mcp",
        content=orjson.dumps(tool_call(arguments)),
        headers=mcp_headers(arguments),
        timeout=10,
    )
    assert mcp.status_code == 200 and not mcp.json()["result"]["isError"]
    upstream = mcp.json()["result"]["structuredContent"]["upstream"]
    assert mcp.headers["x-kvgate-upstream"] == upstream


def test_sigterm_drains_every_worker_and_a_killed_parent_leaves_none(
    log_dir: Path, upstreams: list[Process]
) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with running([gateway(log_dir, upstreams, "--workers", "2")], 60) as (front,):
            assert front.process is not None
            workers = children(front.process.pid)
            assert len(workers) == 2 and served_by(front.base, "k")
            front.process.send_signal(sig)
            code = front.process.wait(30)
            assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
            deadline = time.monotonic() + 10
            while any(alive(w) for w in workers):
                assert time.monotonic() < deadline, f"workers left after {sig.name}"
                time.sleep(0.05)


def test_workers_over_an_in_process_engine_are_refused() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvgate", "serve", "--workers", "2", "--in-process-engine"],
        cwd=REPO_ROOT,
        env={**os.environ, "KVGATE_WORKERS": "2"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "--workers N over an embedded engine needs its own process" in done.stderr
