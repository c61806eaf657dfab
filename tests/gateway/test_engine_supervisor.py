"""``kvgate serve`` with the embedded engine in a process of its own, with real processes:
the engine killed mid-stream (the stream ends with an error event, a tool call with a tool
error, readiness drops at once and returns once the engine is started again); an API worker
killed (the engine and the other worker serve on); SIGTERM drains every worker before the
engine stops; a parent killed with SIGKILL leaves no process behind."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from kvgate.engine.loading.tiny_model import default_model_dir
from tests.gateway.ops.test_metrics import sample
from tests.gateway.upstream.processes import (
    Process,
    alive,
    children,
    mcp_headers,
    running,
    tool_call,
)
from tests.lora_adapters import ADAPTER_A, ADAPTER_B, make_adapter

MODEL = "tiny-model-v3"
LONG = {"model": MODEL, "prompt": "Hello", "max_tokens": 3000, "ignore_eos": True}


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-process")


def is_engine(pid: int) -> bool:
    try:
        return b"kvgate.engine.process.core_process" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return False


def engine_of(pid: int) -> int:
    (engine,) = [c for c in children(pid) if is_engine(c)]
    return engine


def wait_for(predicate: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def complete(base: str, max_tokens: int = 4) -> httpx.Response:
    """A completion of exactly ``max_tokens`` tokens: sampled, but never ended by an EOS."""
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True}
    with httpx.Client(timeout=30) as client:  # a new connection: any worker may take it
        return client.post(base + "/v1/completions", json=body)


def started_stream(base: str, events: list[str], started: threading.Event) -> None:
    """A long streamed completion; its lines into ``events``, ``started`` at the first token."""
    with httpx.stream(
        "POST", base + "/v1/completions", json={**LONG, "stream": True}, timeout=60
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line:
                events.append(line)
                started.set()


@pytest.fixture(scope="module")
def single(log_dir: Path) -> Iterator[Process]:
    """``kvgate serve``: one API process, the engine its child."""
    with running([Process(log_dir)], 600) as (server,):
        yield server


@pytest.fixture(scope="module")
def two(log_dir: Path) -> Iterator[Process]:
    """``kvgate serve --workers 2``: a supervisor, two API workers and the engine."""
    with running([Process(log_dir, "--workers", "2")], 600) as (server,):
        yield server


def test_the_engine_runs_apart_with_every_core(single: Process) -> None:
    assert single.process is not None
    engine = engine_of(single.process.pid)
    assert complete(single.base).status_code == 200
    assert "threads 2 (of 2 usable cores)" in single.log() or "threads 1 (of 1" in single.log()
    assert b"torch" not in Path(f"/proc/{single.process.pid}/maps").read_bytes()
    assert alive(engine)


def test_a_killed_engine_fails_calls_cleanly_and_comes_back(single: Process) -> None:
    assert single.process is not None
    engine = engine_of(single.process.pid)
    events: list[str] = []
    started = threading.Event()
    reader = threading.Thread(target=started_stream, args=(single.base, events, started))
    reader.start()
    assert started.wait(60)
    arguments = {"prompt": "Hello", "max_tokens": 3000, "ignore_eos": True, "cache_key": "k"}
    results: list[dict[str, object]] = []
    tool = threading.Thread(
        target=lambda: results.append(
            httpx.post(
                single.base + "/mcp",
                content=orjson.dumps(tool_call(arguments)),
                headers=mcp_headers(arguments),
                timeout=60,
            ).json()
        )
    )
    tool.start()
    time.sleep(0.5)  # the tool call is admitted and generating
    os.kill(engine, signal.SIGKILL)
    wait_for(lambda: not single.ready(), 2, "/readyz stayed ready without an engine")
    reader.join(30)
    tool.join(30)
    assert events[-1] == "data: [DONE]"
    error = orjson.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "engine process exited" in error["message"]
    (answer,) = results
    assert answer["result"]["isError"] is True, answer  # type: ignore[index]
    refused = complete(single.base)  # until it is back: a clean 503, or an answer
    assert refused.status_code in (200, 503), refused.text
    wait_for(single.ready, 120, "the engine was not started again")
    assert engine_of(single.process.pid) != engine
    assert complete(single.base).status_code == 200
    assert "engine process exited with -9: starting it again" in single.log()


@pytest.fixture(scope="module")
def with_adapters(log_dir: Path) -> Iterator[tuple[Process, dict[str, Path]]]:
    """``kvgate serve`` with adapter "b" from ``--lora-modules``, runtime loading allowed."""
    pytest.importorskip("peft")
    root, base = log_dir / "lora", default_model_dir()
    adapters = {
        "a": make_adapter(base, root / "a", **ADAPTER_A),  # type: ignore[arg-type]
        "b": make_adapter(base, root / "b", **ADAPTER_B),  # type: ignore[arg-type]
    }
    flags = ("--enable-lora", "--allow-runtime-lora-updating")
    flags += ("--lora-modules", f"b={adapters['b']}")
    with running([Process(log_dir, *flags)], 600) as (server,):
        yield server, adapters


def test_a_restarted_engine_serves_the_adapters_loaded_and_removed_at_run_time(
    with_adapters: tuple[Process, dict[str, Path]],
) -> None:
    server, adapters = with_adapters
    assert server.process is not None

    def served() -> list[str]:
        models = httpx.get(server.base + "/v1/models", timeout=5).json()["data"]
        return [m["id"] for m in models[1:]]

    def post(path: str, body: dict[str, str]) -> None:
        assert httpx.post(server.base + path, json=body, timeout=60).status_code == 200

    post("/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["a"])})
    post("/v1/unload_lora_adapter", {"lora_name": "b"})
    assert served() == ["a"]
    os.kill(engine_of(server.process.pid), signal.SIGKILL)
    wait_for(lambda: not server.ready(), 2, "/readyz stayed ready without an engine")
    wait_for(server.ready, 120, "the engine was not started again")
    assert served() == ["a"]  # not "b" again, as --lora-modules alone would have it
    body = {"model": "a", "prompt": "Hi", "max_tokens": 4}
    assert httpx.post(server.base + "/v1/completions", json=body, timeout=30).status_code == 200


def test_a_killed_parent_leaves_no_process(single: Process) -> None:
    assert single.process is not None
    engine = engine_of(single.process.pid)
    single.signal(signal.SIGKILL)
    wait_for(lambda: not alive(engine), 10, "the engine outlived its parent")


def test_workers_share_one_engine_and_answer_alike(two: Process) -> None:
    assert two.process is not None
    kids = children(two.process.pid)
    engines = [c for c in kids if is_engine(c)]
    assert len(engines) == 1 and len(kids) == 3
    for _ in range(6):
        assert complete(two.base).status_code == 200
    models = {httpx.get(two.base + "/v1/models", timeout=5).text for _ in range(8)}
    assert len(models) == 1
    info = {
        line
        for _ in range(8)
        for line in httpx.get(two.base + "/metrics", timeout=5).text.splitlines()
        if line.startswith("vllm:cache_config_info")
    }
    assert len(info) == 1

    def generated() -> set[float]:  # as each worker reads the engine's figures
        texts = [httpx.get(two.base + "/metrics", timeout=5).text for _ in range(8)]
        return {sample(text, "vllm:generation_tokens_total") for text in texts}

    wait_for(lambda: generated() == {6 * 4}, 2, "a worker's /metrics is not the whole server's")


def test_a_killed_worker_leaves_the_engine_and_the_other(two: Process) -> None:
    assert two.process is not None
    engine = engine_of(two.process.pid)
    workers = [c for c in children(two.process.pid) if c != engine]
    os.kill(workers[0], signal.SIGKILL)
    for _ in range(8):  # new connections: the live worker (the kernel skips a closed socket)
        assert complete(two.base).status_code == 200
    wait_for(
        lambda: len([c for c in children(two.process.pid) if alive(c)]) == 3,  # type: ignore[union-attr]
        30,
        "the worker was not started again",
    )
    assert engine_of(two.process.pid) == engine and alive(workers[1])
    wait_for(two.ready, 30, "not ready after a worker restart")


def test_sigterm_drains_the_workers_then_stops_the_engine(two: Process) -> None:
    assert two.process is not None
    kids = children(two.process.pid)
    answers: list[httpx.Response] = []
    call = threading.Thread(target=lambda: answers.append(complete(two.base, 200)))
    call.start()
    time.sleep(0.5)  # in flight
    two.signal(signal.SIGTERM)
    call.join(60)
    assert two.process.wait(60) == 0
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 200
    wait_for(lambda: not any(alive(k) for k in kids), 10, "a process outlived the drain")


def test_the_restart_pause_doubles_with_quick_deaths_and_stops_at_fatal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvgate.gateway import engine_supervisor
    from kvgate.gateway.engine_supervisor import BACKOFF_MAX_S, FATAL, STEADY_S, EngineSupervisor

    now = [1000.0]
    monkeypatch.setattr(engine_supervisor.time, "monotonic", lambda: now[0])
    engine = EngineSupervisor(object(), [])
    try:
        engine._started_at = now[0]
        assert [engine.restart_delay(-9) for _ in range(8)] == [
            0.5,
            1.0,
            2.0,
            4.0,
            8.0,
            16.0,
            BACKOFF_MAX_S,
            BACKOFF_MAX_S,
        ]
        now[0] += STEADY_S  # it ran a while: the count starts again
        assert engine.restart_delay(-9) == 0.5
        assert engine.restart_delay(FATAL) is None  # it cannot load its model
        engine.stopping = True
        assert engine.restart_delay(-9) is None
    finally:
        engine.stop()
    assert not Path(engine.folder).exists()
