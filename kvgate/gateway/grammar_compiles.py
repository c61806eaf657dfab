"""Grammar compiles for the embedded engine, kept from holding anyone else up.

A spec not yet compiled is compiled here before its request is submitted (xgrammar takes from
milliseconds to seconds): on two threads of their own, so they never queue behind prompt
preparation — specs up to ``SMALL_GRAMMAR_BYTES`` on one (a schema, a tool: ~0.1 s or less),
larger ones on the other —, tenants taking turns on each, one compile per spec however many
calls wait for it, and a started compile waited for at most ``timeout_s`` (it then finishes in
the background and fills the cache; the call gets a 400 naming ``structured_outputs``).
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvgate.engine.errors import InvalidArgument
from kvgate.engine.sampling_params import StructuredOutputs

SMALL_GRAMMAR_BYTES = 4 * 2**10  # specs up to this compile in ~0.1 s or less (a schema, a tool)
GRAMMAR_COMPILE_TIMEOUT_S = 20.0  # a started compile a call waits for (the largest: 1-4 s)


class _Compile:
    """One spec's compile, whoever waits for it."""

    def __init__(self, work: Callable[[], None], loop: asyncio.AbstractEventLoop) -> None:
        self.work = work
        self.started_at = 0.0
        self.started: asyncio.Future[None] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.waiters = 0


class _Lane:
    """One compile thread. Tenants waiting on it take turns: the next compile is the oldest
    of the tenant served least since it began waiting (a tenant with a queue of compiles gets
    one, then every other waiting tenant gets one), so no tenant waits for more than one
    compile of each other tenant's."""

    def __init__(self, name: str) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix=name)
        self._queues: OrderedDict[str, deque[_Compile]] = OrderedDict()
        self._served: dict[str, int] = {}  # compiles started, per tenant still waiting
        self._busy = False

    def submit(self, tenant: str, job: _Compile) -> None:
        self._queues.setdefault(tenant, deque()).append(job)
        self._next()

    def _next(self) -> None:
        while not self._busy and self._queues:
            tenant = min(self._queues, key=lambda t: self._served.get(t, 0))  # first of least
            queue = self._queues[tenant]
            job = queue.popleft()
            if not queue:
                del self._queues[tenant]
            if job.waiters == 0:  # every call for it went away before it started
                job.done.cancel()
                continue
            self._busy = True
            self._served[tenant] = self._served.get(tenant, 0) + 1
            job.started_at = time.monotonic()
            job.started.set_result(None)
            future = asyncio.wrap_future(self._thread.submit(job.work))
            future.add_done_callback(functools.partial(self._finished, tenant, job))

    def _finished(self, tenant: str, job: _Compile, future: asyncio.Future[None]) -> None:
        self._busy = False
        if tenant not in self._queues:
            self._served.pop(tenant, None)  # nothing more waiting: its count starts over
        if not job.done.done():
            if future.cancelled():
                job.done.cancel()
            elif (exc := future.exception()) is not None:
                job.done.set_exception(exc)
            else:
                job.done.set_result(None)
        self._next()

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


class GrammarCompiles:
    """Grammar compiles off the event loop, bounded so that no tenant's compiles hold up
    another's: two threads of their own (not the prepare pool's, so tokenizing never waits
    behind a compile), one for specs up to ``SMALL_GRAMMAR_BYTES`` and one for larger ones,
    so a tiny new schema never waits behind a big compile; on each, tenants take turns; one
    spec compiles once however many calls wait for it; and a call waits at most ``timeout_s``
    for a compile once it has started (then a 400 naming ``structured_outputs``; the compile
    runs out and fills the cache). Specs over the engine's ``max_grammar_bytes`` are refused
    before they queue. Runs on the event loop (not thread-safe)."""

    def __init__(
        self,
        compile_grammar: Callable[[StructuredOutputs], None],
        max_bytes: int = 0,
        timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S,
    ) -> None:
        self._compile_grammar = compile_grammar
        self.max_bytes, self.timeout_s = max_bytes, timeout_s
        self._lanes = (_Lane("kvgate-prepare-grammar-s"), _Lane("kvgate-prepare-grammar-l"))
        self._pending: dict[str, _Compile] = {}

    async def compile(self, spec: StructuredOutputs, tenant: str) -> None:
        if self.max_bytes:
            spec.check_size(self.max_bytes)
        key = spec.digest
        job = self._pending.get(key)
        if job is None:
            job = _Compile(
                functools.partial(self._compile_grammar, spec), asyncio.get_running_loop()
            )
            self._pending[key] = job
            job.done.add_done_callback(functools.partial(self._forget, key))
            job.waiters += 1  # before it can start: a job nobody waits for is skipped
            self._lanes[spec.size > SMALL_GRAMMAR_BYTES].submit(tenant, job)
        else:
            job.waiters += 1
        try:  # queued: the call's own deadline bounds the wait for a turn
            await asyncio.wait((job.started, job.done), return_when=asyncio.FIRST_COMPLETED)
            if not job.done.done():
                left = job.started_at + self.timeout_s - time.monotonic()
                await asyncio.wait_for(asyncio.shield(job.done), max(left, 0.0))
            await job.done
        except TimeoutError:
            raise InvalidArgument(
                f"structured_outputs.{spec.kind}: not compiled within {self.timeout_s:g} s; "
                "use a smaller schema or grammar",
                "structured_outputs",
            ) from None
        finally:
            job.waiters -= 1

    def _forget(self, key: str, done: asyncio.Future[None]) -> None:
        self._pending.pop(key, None)
        if not done.cancelled():
            done.exception()  # retrieved: every call waiting for it may have gone

    def close(self) -> None:
        for lane in self._lanes:
            lane.close()
