"""Grammar compiles under hostile load (issue 27): one tenant's big compiles never hold up
another tenant's tiny new schema, tenants take turns, the same spec compiles once, a started
compile is waited for at most the deadline, and an oversized spec is refused before it queues.

Compiles are the engine's real ones; the big ones are held at a gate so the order is exact."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from kvgate.engine import AsyncLLM, SamplingParams
from kvgate.engine.errors import InvalidArgument
from kvgate.engine.sampling_params import StructuredOutputs
from kvgate.gateway.auth.identity import CURRENT, Identity
from kvgate.gateway.embedded import EngineBackend
from kvgate.gateway.generation import GenerationRequest
from kvgate.gateway.grammar_compiles import SMALL_GRAMMAR_BYTES, GrammarCompiles

_tags = itertools.count()


def _big() -> StructuredOutputs:
    tag = next(_tags)
    spec = StructuredOutputs(choice=[f"big list {tag} entry number {i}" for i in range(300)])
    assert spec.size > SMALL_GRAMMAR_BYTES
    return spec


def _tiny() -> StructuredOutputs:
    return StructuredOutputs(json={"type": "object", "properties": {f"t{next(_tags)}": {}}})


class Gated:
    """The engine's compile, with specs larger than the small lane's held until released."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.compile = engine.compile_grammar  # before the fixture puts this in its place
        self.started: list[StructuredOutputs] = []
        self.calls: list[StructuredOutputs] = []
        self.gates: dict[str, threading.Event] = {}
        self.lock = threading.Lock()
        self.open = False

    def gate(self, spec: StructuredOutputs) -> threading.Event:
        with self.lock:
            event = self.gates.setdefault(spec.digest, threading.Event())
            if self.open:
                event.set()
            return event

    def __call__(self, spec: StructuredOutputs) -> None:
        with self.lock:
            self.calls.append(spec)
        if spec.size > SMALL_GRAMMAR_BYTES:
            with self.lock:
                self.started.append(spec)
            assert self.gate(spec).wait(30)
        self.compile(spec)

    def release_all(self) -> None:
        with self.lock:
            self.open = True
            for event in self.gates.values():
                event.set()


@pytest.fixture
def gated(engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> Iterator[Gated]:
    gate = Gated(engine)
    monkeypatch.setattr(engine, "compile_grammar", gate)
    yield gate
    gate.release_all()


def _as(tenant: str, work: Callable[[], Awaitable[Any]]) -> asyncio.Task[Any]:
    async def run() -> Any:
        CURRENT.set(Identity(f"key:{tenant}", None))
        return await work()

    return asyncio.ensure_future(run())


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def _start(backend: EngineBackend, spec: StructuredOutputs) -> Callable[[], Awaitable[None]]:
    async def run() -> None:
        params = SamplingParams(max_tokens=2, temperature=0, structured_outputs=spec)
        stream = await backend.start(GenerationRequest(params, prompt="Hi"))
        await stream.aclose()

    return run


def test_a_tiny_new_schema_does_not_wait_behind_another_tenants_big_compiles(
    engine: AsyncLLM, gated: Gated
) -> None:
    async def run() -> None:
        backend = EngineBackend(engine)
        try:
            big = [_as("a", _start(backend, _big())) for _ in range(2)]
            await _until(lambda: len(gated.started) == 1)  # a's first holds the big lane
            await asyncio.wait_for(_as("b", _start(backend, _tiny())), 10)  # b: not held up
            assert not any(task.done() for task in big)
            gated.release_all()
            await asyncio.gather(*big)
        finally:
            gated.release_all()
            await backend.aclose()

    asyncio.run(run())


def test_tenants_take_turns_and_one_spec_compiles_once(engine: AsyncLLM, gated: Gated) -> None:
    async def run() -> None:
        compiles = GrammarCompiles(engine.compile_grammar)
        try:
            a = [_big() for _ in range(3)]
            c = _big()
            tasks = [_as("a", lambda s=s: compiles.compile(s, "a")) for s in a]
            await _until(lambda: len(gated.started) == 1)
            tasks.append(_as("c", lambda: compiles.compile(c, "c")))
            same = [_as("d", lambda: compiles.compile(a[2], "d")) for _ in range(3)]
            for spec in (a[0], c, a[1], a[2]):  # c's turn comes before a's second
                await _until(lambda spec=spec: gated.started[-1] is spec)
                gated.gate(spec).set()
            await asyncio.gather(*tasks, *same)
            assert gated.started == [a[0], c, a[1], a[2]]
            assert [s for s in gated.calls if s is a[2]] == [a[2]]  # four callers, one compile
            assert all(engine.grammar_compiled(s) for s in (*a, c))
        finally:
            gated.release_all()
            compiles.close()

    asyncio.run(run())


def test_a_started_compile_is_waited_for_at_most_the_deadline(
    engine: AsyncLLM, gated: Gated
) -> None:
    async def run() -> None:
        compiles = GrammarCompiles(engine.compile_grammar, timeout_s=0.3)
        spec = _big()
        try:
            loop = asyncio.get_running_loop()
            began = loop.time()
            with pytest.raises(InvalidArgument, match="not compiled within 0.3 s") as caught:
                await compiles.compile(spec, "a")
            assert caught.value.field == "structured_outputs" and loop.time() - began < 5
            gated.gate(spec).set()  # the compile runs out and fills the cache
            await _until(lambda: engine.grammar_compiled(spec))
        finally:
            gated.release_all()
            compiles.close()

    asyncio.run(run())


def test_an_oversized_spec_is_refused_before_it_queues(engine: AsyncLLM, gated: Gated) -> None:
    limit = engine.stats().max_grammar_bytes
    assert limit == 128 * 2**10
    huge = StructuredOutputs(
        choice=[f"entry {i} of a list too long to compile" for i in range(4000)]
    )
    assert huge.size > limit

    async def run() -> None:
        backend = EngineBackend(engine)
        try:
            held = _as("a", _start(backend, _big()))
            await _until(lambda: len(gated.started) == 1)  # the big lane is busy
            with pytest.raises(InvalidArgument, match=f"at most {limit} on this server"):
                await asyncio.wait_for(_as("b", _start(backend, huge)), 5)
            assert huge not in gated.calls
            gated.release_all()
            await held
        finally:
            gated.release_all()
            await backend.aclose()

    asyncio.run(run())
