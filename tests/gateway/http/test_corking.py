"""CorkedTransport: what one loop turn writes leaves as one write; a close sends it first."""

from __future__ import annotations

import asyncio
from typing import Any

from kvgate.gateway.http.corking import CorkedTransport


class Recording:
    """The part of a transport the cork uses, recording each write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else None


def test_one_turns_writes_leave_together() -> None:
    async def run() -> None:
        raw = Recording()
        cork = CorkedTransport(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
        cork.write(b"HTTP/1.1 200 OK\r\n\r\n")
        cork.write(memoryview(b"body"))
        assert raw.writes == []
        await asyncio.sleep(0)
        assert raw.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
        cork.write(b"next")
        await asyncio.sleep(0)
        assert raw.writes[1:] == [b"next"]
        assert cork.get_extra_info("peername") == ("127.0.0.1", 1)  # the rest is the raw one's

    asyncio.run(run())


def test_a_close_sends_what_is_corked_first() -> None:
    async def run() -> None:
        raw = Recording()
        cork = CorkedTransport(raw, asyncio.get_running_loop())  # type: ignore[arg-type]
        cork.write(b"last words")
        cork.close()
        assert raw.writes == [b"last words"] and raw.closed
        await asyncio.sleep(0)  # the scheduled flush finds nothing more to send
        assert raw.writes == [b"last words"]

    asyncio.run(run())
