"""``TrimAfterLargeBodies``: a request with a large body is followed by one ``malloc_trim``
(on a worker thread), small ones by none, and trims never overlap."""

from __future__ import annotations

import asyncio
import threading

import httpx
from starlette.types import Receive, Scope, Send

from kvgate.gateway.http.trim import TrimAfterLargeBodies, malloc_trim


async def echo_size(scope: Scope, receive: Receive, send: Send) -> None:
    size, more = 0, True
    while more:
        message = await receive()
        size, more = size + len(message.get("body", b"")), message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": str(size).encode()})


def test_glibc_has_malloc_trim() -> None:
    trim = malloc_trim()
    assert trim is not None and trim(0) in (0, 1)


async def test_only_a_large_body_is_followed_by_a_trim() -> None:
    app = TrimAfterLargeBodies(echo_size, min_bytes=1000)
    calls: list[int] = []
    app.trim = lambda pad: calls.append(pad) or 1
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        assert (await c.post("/", content=b"x" * 999)).text == "999"
        assert (await c.post("/", content=b"x" * 1000)).text == "1000"
        for _ in range(100):
            if app.trims:
                break
            await asyncio.sleep(0.01)
    assert calls == [0] and app.trims == 1


async def test_trims_never_overlap_and_none_is_lost() -> None:
    """Requests ending while a trim runs get one more trim after it, not one each."""
    app = TrimAfterLargeBodies(echo_size, min_bytes=10)
    release, running, calls = threading.Event(), threading.Event(), []

    def slow_trim(pad: int) -> int:
        calls.append(pad)
        running.set()
        release.wait(5)
        return 1

    app.trim = slow_trim
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as c:
        await c.post("/", content=b"x" * 10)
        await asyncio.to_thread(running.wait, 5)
        for _ in range(3):
            await c.post("/", content=b"x" * 10)  # ends while the first trim runs
        release.set()
        for _ in range(200):
            if app.trims == 2:
                break
            await asyncio.sleep(0.01)
    assert len(calls) == 2 and app.trims == 2
