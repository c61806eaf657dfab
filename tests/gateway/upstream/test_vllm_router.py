"""kvgate engine servers behind vllm-router (skipped when it is not installed), with its
``cache_aware`` and ``round_robin`` policies: calls through it complete, streamed or not, and
every request it sends a worker — ``/health``, and for ``cache_aware`` the render of each call
(``/v1/chat/completions/render``, ``/v1/completions/render``, ``/v1/responses/render``;
``/tokenize`` only were a render 404) — is answered, never 404 or 405. A recording proxy in front of each worker sees them."""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from tests.gateway.live_server import free_port
from tests.gateway.upstream.processes import Process, peer, running

pytest.importorskip("vllm_router")
pytestmark = pytest.mark.slow  # two engine servers and a router: tens of seconds
PASSED_ON = ("content-type", "retry-after", "x-kvgate-upstream")


class Recorder:
    """A reverse proxy on loopback in front of ``target`` that notes the method, path and
    status of every request it relays (a kvgate server writes no access log)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.seen: list[tuple[str, str, int]] = []
        self.base = f"http://127.0.0.1:{free_port()}"
        methods = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH"]
        app = Starlette(routes=[Route("/{path:path}", self.relay, methods=methods)])
        config = uvicorn.Config(
            app, host="127.0.0.1", port=int(self.base.rsplit(":", 1)[1]), log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    async def relay(self, request: Request) -> StreamingResponse:
        client = httpx.AsyncClient(base_url=self.target, timeout=60)
        sent = client.build_request(
            request.method,
            request.url.path,
            params=request.query_params,
            content=await request.body(),
            headers={k: v for k, v in request.headers.items() if k in ("content-type", "accept")},
        )
        answer = await client.send(sent, stream=True)
        self.seen.append((request.method, request.url.path, answer.status_code))

        async def close() -> None:
            await answer.aclose()
            await client.aclose()

        async def body() -> AsyncIterator[bytes]:
            async for chunk in answer.aiter_raw():
                yield chunk

        headers = {k: v for k, v in answer.headers.items() if k in PASSED_ON}
        return StreamingResponse(
            body(), answer.status_code, headers, background=BackgroundTask(close)
        )

    def __enter__(self) -> Recorder:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "no proxy"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Recorder]]:
    log_dir = tmp_path_factory.mktemp("vllm-router-workers")
    with running([Process(log_dir) for _ in range(2)]) as started:
        recorders = [Recorder(w.base) for w in started]
        with recorders[0], recorders[1]:
            yield recorders


@pytest.fixture(scope="module", params=["cache_aware", "round_robin"])
def router(
    request: pytest.FixtureRequest,
    workers: list[Recorder],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, str, Path]]:
    policy = request.param
    base = f"http://127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("vllm-router") / f"{policy}.log"
    command = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1"]
    command += ["--port", base.rsplit(":", 1)[1], "--worker-urls", *(w.base for w in workers)]
    command += ["--policy", policy, "--log-level", "info", "--worker-startup-check-interval", "1"]
    command += ["--prometheus-port", str(free_port())]  # its own metrics listener: 29000
    for worker in workers:
        worker.seen.clear()
    with peer(command, log, base + "/v1/models", 60):
        yield policy, base, log


def test_calls_through_it_complete_and_every_probe_is_answered(
    router: tuple[str, str, Path], workers: list[Recorder]
) -> None:
    policy, base, log = router
    model = httpx.get(base + "/v1/models", timeout=5).json()["data"][0]["id"]
    history = [{"role": "user", "content": "hi"}]
    for i in range(4):  # a growing conversation: a shared prefix to route on
        body = {"model": model, "messages": history, "max_tokens": 4, "seed": i}
        answer = httpx.post(base + "/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        reply = answer.json()["choices"][0]["message"]["content"]
        history += [{"role": "assistant", "content": reply}, {"role": "user", "content": str(i)}]
    for prompt in ("Once upon a time", ["a b", "c d"]):
        body = {"model": model, "prompt": prompt, "max_tokens": 3}
        answer = httpx.post(base + "/v1/completions", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["choices"]) == (1 if isinstance(prompt, str) else 2)
    body = {"model": model, "input": "hi", "max_output_tokens": 3}
    answer = httpx.post(base + "/v1/responses", json=body, timeout=30)
    assert answer.status_code == 200 and answer.json()["object"] == "response", answer.text
    streamed_body = {"model": model, "messages": history, "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST", base + "/v1/chat/completions", json=streamed_body, timeout=30
    ) as streamed:
        assert streamed.status_code == 200
        assert list(streamed.iter_lines())[-2:] == ["data: [DONE]", ""]
    seen = [s for w in workers for s in w.seen]
    assert [s for s in seen if s[2] >= 400] == [], seen
    paths = {path for _, path, _ in seen}
    assert {"/v1/chat/completions", "/v1/completions"} <= paths
    if policy == "cache_aware":  # render answered, so no /tokenize fallback
        rendered = {"/v1/chat/completions/render", "/v1/completions/render", "/v1/responses/render"}
        assert rendered <= paths
        assert "/tokenize" not in paths
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))  # its colours
    assert " WARN " not in text and " ERROR " not in text, text[-2000:]
