"""Tasks in fleet mode: the gateway that owns the task consumes the upstream's stream (the one
call path, ``Generations``); cancelling the task closes the upstream connection, so the
upstream engine stops the generation."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest

from kvgate.gateway.settings import Settings
from kvgate.gateway.upstream.fleet import Fleet
from tests.gateway.live_server import LiveServer
from tests.gateway.tasks.client import TASK_HINT, generate, poll_until, task_call

SHORT = {"prompt": "Once upon a time", "max_tokens": 24}
LONG = {"prompt": "A long story", "max_tokens": 3000}


@pytest.fixture(scope="module")
def fleet_server(server: LiveServer) -> Iterator[LiveServer]:
    settings = Settings(upstream=(server.base,), upstream_health_interval_s=0)
    with LiveServer(None, backend=Fleet.connect(settings), task_poll_interval_s=0.1) as live:
        yield live


def upstream_running(server: LiveServer) -> float:
    text = httpx.get(server.base + "/metrics").text
    match = re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)
    assert match is not None
    return float(match[1])


def test_a_fleet_task_completes_with_the_upstream_answer_and_cancels_upstream(
    fleet_server: LiveServer, server: LiveServer
) -> None:
    with httpx.Client(timeout=30) as http:
        direct = generate(http, server.url, SHORT, declared=False).result
        created = generate(http, fleet_server.url, SHORT, meta=TASK_HINT).result
        done = poll_until(http, fleet_server.url, created["taskId"], ("completed",))
        assert done["result"]["structuredContent"]["text"] == direct["structuredContent"]["text"]
        assert done["result"]["structuredContent"]["upstream"] == server.base

        long = generate(http, fleet_server.url, LONG, meta=TASK_HINT).result
        poll_until(http, fleet_server.url, long["taskId"], ("working",))
        deadline = time.monotonic() + 5
        while upstream_running(server) == 0:  # the upstream has begun generating
            assert time.monotonic() < deadline
            time.sleep(0.02)
        task_call(http, fleet_server.url, "tasks/cancel", long["taskId"])
        poll_until(http, fleet_server.url, long["taskId"], ("cancelled",), timeout_s=5)
        while upstream_running(server) != 0:
            assert time.monotonic() < deadline + 5, "the upstream still generates"
            time.sleep(0.02)
