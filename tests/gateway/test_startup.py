"""``kvgate serve`` starts like a server, with real processes on loopback (stopped by pid):
a busy port fails at once naming ``--port``; the port answers from before the model is loaded
(``/healthz`` 200, ``/readyz`` 503 with what is loading, anything else 503 with
``Retry-After``) until the app takes it over; the start ends with the URLs and a curl."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.gateway.live_server import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


def serve(port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "kvgate", "serve", "--port", str(port), "--model", "tiny"],
            cwd=REPO_ROOT,
            env={**os.environ, "KVGATE_KV_CACHE_MEMORY": "16MiB"},
            stdout=subprocess.DEVNULL,
            stderr=out,
        )


def test_a_busy_port_fails_at_once_naming_the_flag() -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        began = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "kvgate", "serve", "--port", str(port), "--model", "tiny"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 1 and time.monotonic() - began < 10  # no model loaded first
    assert done.stderr.strip() == (
        f"kvgate: cannot listen on 127.0.0.1:{port}: Address already in use; choose another "
        f"--port, or see which process holds it: ss -ltnp 'sport = :{port}'"
    )


def test_the_port_answers_while_loading_then_the_start_ends_with_the_urls(
    tmp_path: Path,
) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}"
    server = serve(port, log)
    loading = []
    try:
        with httpx.Client(base_url=base, timeout=5) as http:
            deadline = time.monotonic() + 300
            while True:
                assert server.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                try:
                    ready = http.get("/readyz")
                    if ready.status_code == 200:
                        break
                    health = http.get("/healthz")
                    call = http.post("/v1/chat/completions", json={"messages": []})
                    if http.get("/readyz").status_code == 200:
                        break  # ready in between: the app, not the loading answer, took them
                except httpx.TransportError:  # not bound yet (Python is starting)
                    time.sleep(0.01)
                    continue
                loading.append((ready, health, call))
        # The model takes over a second to load: the port answered long before it was ready.
        assert loading, "/readyz was never seen loading"
        for ready, health, call in loading:
            assert ready.status_code == 503 and ready.json()["ready"] is False
            # 0/4: answering already, the first step not yet begun (seen on a loaded machine)
            assert ready.json()["loading"].split()[-1] in {f"{i}/4" for i in range(5)}
            assert health.status_code == 200 and health.json()["status"] == "ok"
            assert call.status_code == 503 and call.headers["retry-after"] == "1"
            assert "kvgate is starting" in call.json()["error"]["message"]
        steps = [int(ready.json()["loading"].split()[-1].split("/")[0]) for ready, _, _ in loading]
        assert steps == sorted(steps)  # the steps only go forward
        deadline = time.monotonic() + 10
        while "try: curl" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        text = log.read_text()
        for step in ("[1/4] starting the engine process", "[2/4] loading model tiny", "[4/4]"):
            assert step in text
        assert f"MCP {base}/mcp, OpenAI-compatible API {base}/v1" in text
        assert f"try: curl -s {base}/v1/chat/completions" in text
        assert '"model":"tiny-model-v3"' in text
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
