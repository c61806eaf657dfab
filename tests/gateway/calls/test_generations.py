"""``Generations``: what every call's generation goes through below the doors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.auth.budgets import Budgets
from gateway.calls.errors import Refused
from gateway.calls.generations import metered
from gateway.generation import TextDelta


async def test_a_stream_cut_short_still_pays_for_what_it_produced() -> None:
    budgets = Budgets(0, 30, None)

    async def deltas() -> AsyncIterator[TextDelta]:
        for _ in range(5):
            yield TextDelta("x", 0, [1] * 10, None)

    stream = metered(deltas(), budgets, "acme")
    for _ in range(3):  # 30 tokens produced, then the client goes away
        await anext(stream)
    await stream.aclose()
    await asyncio.sleep(0.01)  # the background debits
    with pytest.raises(Refused):
        await budgets.admit("acme")
    await budgets.close()
