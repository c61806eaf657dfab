"""``Generations``: what every call's generation (and embeddings call) goes through below the
doors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvgate.engine.errors import EngineOverloaded, EngineStepError, InvalidArgument, TooManyTokens
from kvgate.gateway.auth import identity
from kvgate.gateway.auth.budgets import Budgets
from kvgate.gateway.calls.errors import BadInput, GenerationFailed, Refused
from kvgate.gateway.calls.generations import Generations, metered
from kvgate.gateway.generation import Embeddings, EmbeddingsRequest, TextDelta


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


class _EmbeddingBackend:
    """A backend that only embeds: the request it was given, or the error it is told to raise."""

    model_name, max_model_len, reads_tool_calls = "stub", 64, True

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.seen: list[EmbeddingsRequest] = []

    async def embed(self, request: EmbeddingsRequest) -> Embeddings:
        self.seen.append(request)
        if self.error is not None:
            raise self.error
        return Embeddings([[1.0, 0.0]] * len(request.inputs), 30)


async def test_embeddings_are_salted_with_the_tenant_and_pay_their_prompt_tokens() -> None:
    budgets = Budgets(0, 30, None)
    backend = _EmbeddingBackend()
    generations = Generations(backend, budgets)  # type: ignore[arg-type]
    token = identity.CURRENT.set(identity.Identity("acme", None))
    try:
        result = await generations.embed(EmbeddingsRequest(["a", "b"], cache_salt="mine"))
    finally:
        identity.CURRENT.reset(token)
    assert result.vectors == [[1.0, 0.0]] * 2
    assert backend.seen[0].cache_salt == f"{identity.salt_of('acme')}/mine"
    with pytest.raises(Refused):  # the 30 prompt tokens spent the tenant's minute
        await budgets.admit("acme")
    await budgets.close()


@pytest.mark.parametrize(
    ("raised", "becomes", "field"),
    [
        (TooManyTokens("too long", 70, 64), BadInput, "input"),
        (InvalidArgument("bad", "input"), BadInput, "input"),
        (EngineOverloaded("full"), Refused, None),
        (EngineStepError("step failed"), GenerationFailed, None),
    ],
)
async def test_an_embeddings_backends_errors_become_call_errors(
    raised: Exception, becomes: type[Exception], field: str | None
) -> None:
    generations = Generations(_EmbeddingBackend(raised), Budgets(0, 0, None))  # type: ignore[arg-type]
    with pytest.raises(becomes) as caught:
        await generations.embed(EmbeddingsRequest(["a"]))
    assert getattr(caught.value, "field", None) == field
