"""A real `kvgate serve` process: SIGHUP reloads the catalog; SIGTERM drains (in-flight calls
finish, listen streams end, new connections are refused) or, past the drain timeout, cancels
what still runs; either way the process exits 0 within its bound. JSON logs parse."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.gateway.live_server import free_port
from tests.gateway.wire import call, modern_headers, modern_meta

REPO_ROOT = Path(__file__).resolve().parents[3]
# Greedy on the tiny model, this prompt never meets end-of-text: exactly max_tokens, seconds long.
LONG_CALL = {
    "name": "generate",
    "arguments": {"prompt": "A long story", "max_tokens": 4000, "temperature": 0},
}


class Kvgate:
    def __init__(self, tmp_path: Path, *flags: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + "/mcp"
        self.log = tmp_path / f"kvgate-{self.port}.log"
        self._log_file = self.log.open("wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvgate",
                "serve",
                "--port",
                str(self.port),
                "--model",
                "tiny",
                "--kv-cache-memory",
                "16MiB",
                "--log-format",
                "json",
                *flags,
            ],
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=self._log_file,
        )
        deadline = time.monotonic() + 120
        try:
            while not self._ready():
                assert self.process.poll() is None, self.log.read_text()
                assert time.monotonic() < deadline, "kvgate did not become ready"
                time.sleep(0.1)
        except BaseException:  # never registered with a fixture: stop it here, not leak it
            self.stop()
            raise

    def _ready(self) -> bool:
        try:
            return httpx.get(self.base + "/readyz", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._log_file.close()

    def log_entries(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.strip()]


@pytest.fixture
def kvgate_factory(tmp_path: Path) -> Iterator:
    started: list[Kvgate] = []

    def start(*flags: str) -> Kvgate:
        started.append(Kvgate(tmp_path, *flags))
        return started[-1]

    yield start
    for server in started:
        server.stop()


def sse(response: httpx.Response) -> Iterator[dict]:
    for line in response.iter_lines():
        if line.startswith("data:"):
            yield orjson.loads(line[5:])


def post_stream(http: httpx.Client, url: str, method: str, params: dict, name: str | None = None):
    body = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": method,
        "params": {**params, "_meta": modern_meta(progressToken="p")},
    }
    return http.stream(
        "POST", url, content=orjson.dumps(body), headers=modern_headers(method, name)
    )


def test_sighup_reloads_and_sigterm_lets_a_call_finish(kvgate_factory, tmp_path: Path) -> None:
    config = tmp_path / "catalog.json"
    config.write_text(json.dumps({"instructions": "Before the signal."}))
    kvgate = kvgate_factory("--catalog-config", str(config), "--drain-timeout", "60")
    second_long_call = {
        "name": "generate",
        "arguments": {"prompt": "A long story", "max_tokens": 1500, "temperature": 0},
    }
    with httpx.Client(timeout=30) as http:
        config.write_text(json.dumps({"instructions": "After the signal."}))
        kvgate.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 5
        while (
            call(http, kvgate.url, "server/discover").result["instructions"] != "After the signal."
        ):
            assert time.monotonic() < deadline, "SIGHUP did not reload the catalog"
            time.sleep(0.05)
        with post_stream(http, kvgate.url, "tools/call", second_long_call, "generate") as response:
            events = sse(response)
            assert next(events)["method"] == "notifications/progress"
            kvgate.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            time.sleep(0.3)  # uvicorn notices the signal within 0.1 s
            with pytest.raises(httpx.ConnectError):  # no longer accepting, still answering
                httpx.get(kvgate.base + "/healthz", timeout=1)
            final = [e for e in events if "result" in e]
    code = kvgate.process.wait(timeout=30)
    assert code == 0 and time.monotonic() - signalled < 30
    structured = final[0]["result"]["structuredContent"]
    # begun before the signal (its first token had arrived), finished in full after it
    assert (structured["completion_tokens"], structured["finish_reason"]) == (1500, "length")
    messages = [entry["message"] for entry in kvgate.log_entries()]
    assert any(m.startswith("SIGHUP: catalog now") for m in messages)
    assert any(m.startswith("SIGTERM: draining") for m in messages) and messages[-1] == "stopped"


def test_past_the_drain_timeout_calls_are_cancelled_and_the_process_exits(kvgate_factory) -> None:
    kvgate = kvgate_factory("--drain-timeout", "1")
    with httpx.Client(timeout=30) as http:
        with post_stream(http, kvgate.url, "tools/call", LONG_CALL, "generate") as response:
            events = sse(response)
            assert next(events)["method"] == "notifications/progress"
            kvgate.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            try:
                rest = list(events)
            except httpx.RemoteProtocolError:  # the server closed the connection mid-stream
                rest = []
    code = kvgate.process.wait(timeout=30)
    elapsed = time.monotonic() - signalled
    assert code == 0 and 1.0 <= elapsed < 15
    assert not any("result" in event for event in rest)  # cancelled, never completed
    assert any(
        entry["message"].startswith("Cancel 1 running task") for entry in kvgate.log_entries()
    )
