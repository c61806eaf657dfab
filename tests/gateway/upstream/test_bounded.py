"""Reading an upstream's stream within bounds: lines that carry no event count, and a read
holding many lines hands them on between turns of the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvgate.gateway.upstream import bounded
from kvgate.gateway.upstream.wire import StreamError

COMMENTS = b":\n" * (1 << 19)  # a megabyte read at once: half a million lines


async def once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def test_comments_and_blank_lines_count_against_the_line_budget() -> None:
    async def run() -> list[str]:
        return [line async for line in bounded.sse_lines(once(COMMENTS), 1 << 21, 1000)]

    with pytest.raises(StreamError, match="over 1000 lines"):
        asyncio.run(run())


def test_a_read_of_many_lines_lets_the_loop_turn_between_them() -> None:
    async def run() -> tuple[int, int]:
        turns = 0

        async def count() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        counting = asyncio.create_task(count())
        await asyncio.sleep(0)
        lines = [line async for line in bounded.sse_lines(once(COMMENTS), 1 << 21, 1 << 20)]
        counting.cancel()
        return len(lines), turns

    lines, turns = asyncio.run(run())
    assert lines == 1 << 19
    assert turns >= lines // bounded.YIELD_LINES
