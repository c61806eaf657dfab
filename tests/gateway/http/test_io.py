"""``until_disconnect``: the work's result, ClientGone when the client leaves first, and no
cancellation leaking into the caller afterwards."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvgate.gateway.http.io import ClientGone, until_disconnect


class Client:
    """An ASGI ``receive`` that reports a disconnect once told to."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.gone.wait()
        return {"type": "http.disconnect"}


def test_the_work_answers_while_the_client_stays() -> None:
    async def run() -> None:
        client = Client()
        assert await until_disconnect(client.receive, asyncio.sleep(0.01, "done")) == "done"
        await asyncio.sleep(0.05)  # still running: no cancellation arrives later

    asyncio.run(run())


def test_a_client_leaving_cancels_the_work() -> None:
    cancelled = asyncio.Event()

    async def work() -> None:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def run() -> None:
        client = Client()
        asyncio.get_running_loop().call_later(0.02, client.gone.set)
        with pytest.raises(ClientGone):
            await until_disconnect(client.receive, work())
        assert cancelled.is_set()
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        await asyncio.sleep(0.01)

    asyncio.run(run())


def test_a_cancel_from_outside_stays_a_cancel() -> None:
    async def run() -> None:
        client = Client()
        task = asyncio.ensure_future(until_disconnect(client.receive, asyncio.sleep(10)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())


def test_a_disconnect_as_the_work_ends_does_not_cancel_the_caller_later() -> None:
    async def work(client: Client) -> str:
        client.gone.set()  # the watcher finishes in the same loop turn as the work
        await asyncio.sleep(0)
        return "done"

    async def run() -> None:
        for _ in range(20):
            client = Client()
            try:
                await until_disconnect(client.receive, work(client))
            except ClientGone:
                pass
            await asyncio.sleep(0.001)  # a stray cancel would land here
            await asyncio.sleep(0.001)

    asyncio.run(run())
