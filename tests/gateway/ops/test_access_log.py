"""The operator's log: one access line per call (status, tokens, TTFT, duration, tenant, never
the prompt), none with ``--no-access-log``; and, from a real ``kvgate serve``, the engine's
stats line while it works."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest

from kvgate.engine import AsyncLLM
from tests.gateway.live_server import LiveServer
from tests.gateway.upstream.processes import Process, mcp_headers, running, tool_call

SECRET = "Zebra-prompt-never-logged"
STATS = re.compile(
    r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
    r"Running: (\d+) reqs, Waiting: (\d+) reqs, KV cache usage: ([\d.]+)%"
)


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """``kvgate serve`` with a short stats interval; the access log on, as by default."""
    log_dir = tmp_path_factory.mktemp("access-log")
    with running([Process(log_dir, "--stats-interval", "0.3")], 300) as (server,):
        yield server


def access_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if " status=" in line and " duration=" in line]


def test_each_call_logs_one_line_with_its_status_and_tokens_and_never_its_prompt(
    serve: Process,
) -> None:
    body = {"prompt": SECRET, "max_tokens": 5, "ignore_eos": True}
    usage = httpx.post(serve.base + "/v1/completions", json=body, timeout=30).json()["usage"]
    arguments = {"prompt": SECRET, "max_tokens": 3}
    answer = httpx.post(
        serve.base + "/mcp",
        content=orjson.dumps(tool_call(arguments)),
        headers=mcp_headers(arguments),
        timeout=30,
    )
    assert answer.status_code == 200
    assert httpx.get(serve.base + "/v1/nowhere", timeout=5).status_code == 404
    httpx.get(serve.base + "/metrics", timeout=5)
    time.sleep(0.2)  # the lines are written once the answers have gone
    lines = access_lines(serve.log())
    completion = [line for line in lines if "openai /v1/completions " in line]
    assert len(completion) == 1
    assert "status=200 outcome=ok" in completion[0]
    tokens = f"tokens_in={usage['prompt_tokens']} tokens_out={usage['completion_tokens']}"
    assert tokens in completion[0]
    assert re.search(r"ttft=\d+\.\d+s duration=\d+\.\d+s tenant=-", completion[0])
    (tool,) = [line for line in lines if "mcp tools/call generate " in line]
    assert "status=200 outcome=ok" in tool and "tokens_out=3" in tool
    assert any("openai unknown status=404" in line for line in lines)
    assert not any("/metrics" in line for line in lines)  # scrapes and probes: no line
    assert SECRET not in serve.log()


def test_the_stats_line_reports_the_work_and_falls_silent_when_idle(serve: Process) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}
    assert httpx.post(serve.base + "/v1/completions", json=body, timeout=60).status_code == 200
    time.sleep(0.8)  # the interval that saw it, then one idle
    figures = [tuple(map(float, m.groups())) for m in STATS.finditer(serve.log())]
    assert any(generation > 0 for _, generation, *_ in figures), figures
    assert figures[-1][2:4] == (0, 0)  # running, waiting: the last line saw the end
    seen = len(figures)
    time.sleep(1.0)  # three idle intervals
    assert len(STATS.findall(serve.log())) == seen


def test_no_access_log_writes_none(engine: AsyncLLM, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvgate.access")
    with LiveServer(engine, access_log=False) as live:
        body = {"prompt": "Hi", "max_tokens": 2}
        assert httpx.post(live.base + "/v1/completions", json=body, timeout=30).status_code == 200
    with LiveServer(engine) as live:
        assert httpx.post(live.base + "/v1/completions", json=body, timeout=30).status_code == 200
    (record,) = [r for r in caplog.records if r.name == "kvgate.access"]
    assert record.getMessage().startswith("openai /v1/completions status=200")
