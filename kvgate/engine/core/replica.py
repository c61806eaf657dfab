"""One engine replica: a scheduler and a runner, stepped by its own thread or by hand.

Other threads talk to a replica only through ``submit`` and ``abort``, which queue work under
a condition variable; the step loop picks it up at the next step boundary and sleeps on the
condition when there is nothing to do (no busy spinning).

Faults stay inside one step: if the model run raises, only the requests of that step fail
(with EngineStepError) and free their blocks; the replica goes on with the next step. A step
that runs past ``step_timeout_s`` marks the replica stalled (``available`` False) until it
returns, so the router and readiness skip it; only a fault in the bookkeeping itself
(scheduling) stops the replica for good.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvgate.engine.core.model_runner import ModelRunner
from kvgate.engine.core.request import Request
from kvgate.engine.core.scheduler import Scheduler
from kvgate.engine.errors import EngineStepError, EngineUnavailable
from kvgate.engine.outputs import StepOutput
from kvgate.engine.stats import ReplicaStats

log = logging.getLogger(__name__)

BLOCKED_RETRY_S = 0.005
# Called from the step thread with each request that has news (or the step's exception).
OutputSink = Callable[[Request, "StepOutput | BaseException"], None]


class Replica:
    def __init__(
        self,
        index: int,
        scheduler: Scheduler,
        runner: ModelRunner,
        on_output: OutputSink | None = None,
        step_timeout_s: float = 120.0,
    ):
        self.index = index
        self.scheduler = scheduler
        self.runner = runner
        self.on_output = on_output
        # Called on the step thread once a step's outputs have all gone to ``on_output``
        # (an engine process sends them to its API processes then, one frame per step).
        self.on_step_end: Callable[[], None] | None = None
        self.step_timeout_s = step_timeout_s
        self.failed: BaseException | None = None
        self.num_failed_steps = 0
        self.last_step_error: EngineStepError | None = None
        self._step_started: float | None = None  # monotonic start of the model run in flight
        self._cond = threading.Condition()
        self._incoming: list[Request] = []
        self._aborts: list[tuple[Request, str]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._last_batch_size = 0

    # -- called from any thread --------------------------------------------------------------

    def submit(self, request: Request) -> None:
        """Queue a request; raises EngineUnavailable once the step loop has died or stopped
        (checked under the lock that drains the queue, so nothing is stranded)."""
        request.replica = self.index
        with self._cond:
            if self.failed is not None or self._stopping:
                reason = "stopped" if self.failed is None else f"failed: {self.failed!r}"
                raise EngineUnavailable(f"engine replica {self.index} has {reason}")
            self._incoming.append(request)
            self._cond.notify()

    def abort(self, request: Request, reason: str = "abort") -> None:
        """Stop a request; its blocks are freed at the next step boundary. ``reason``: how it
        ended, as its figures count it ("stop" when a stop string ended it)."""
        with self._cond:
            self._aborts.append((request, reason))
            self._cond.notify()

    @property
    def load(self) -> int:
        """Requests this replica holds: queued, waiting and running."""
        with self._cond:
            queued = len(self._incoming)
        return queued + len(self.scheduler.waiting) + len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Requests submitted but not yet running (what admission bounds)."""
        with self._cond:
            queued = len(self._incoming)
        return queued + len(self.scheduler.waiting)

    @property
    def stalled(self) -> bool:
        """The model run in flight has taken longer than ``step_timeout_s`` (the watchdog)."""
        started = self._step_started
        return started is not None and time.monotonic() - started > self.step_timeout_s

    @property
    def available(self) -> bool:
        alive = self._thread is None or self._thread.is_alive()
        return self.failed is None and alive and not self.stalled

    def stats(self) -> ReplicaStats:
        kv = self.scheduler.kv
        with self._cond:
            queued = len(self._incoming)
        return ReplicaStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + queued,
            kv_usage=kv.usage,
            prefix_queries=kv.prefix_queries,
            prefix_hits=kv.prefix_hits,
        )

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._loop, name=f"kvgate-replica-{self.index}", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join()

    # -- the step thread (or a test stepping by hand) ----------------------------------------

    def has_work(self) -> bool:
        with self._cond:
            return bool(self._incoming or self._aborts) or self.scheduler.has_work()

    def step(self) -> list[Request]:
        """One step boundary and one step; returns the requests that got a token."""
        with self._cond:
            incoming, self._incoming = self._incoming, []
            aborts, self._aborts = self._aborts, []
        for request in incoming:
            self.scheduler.add(request)
        for request, reason in aborts:
            if not request.finished:
                self.scheduler.abort(request, reason)
        batch = self.scheduler.schedule()
        self._last_batch_size = len(batch)
        if not batch:
            return []
        self._step_started = time.monotonic()
        try:
            result = self.runner.execute(batch)
        except Exception as exc:  # noqa: BLE001 - fails this step's requests, not the replica
            self._fail_step(batch.requests, exc)
            return []
        finally:
            self._step_started = None
        changed = self.scheduler.update(batch, result.sampled, result.pooled, result.accepted)
        if self.on_output is not None:
            for request in changed:
                self.on_output(request, request.take_step_output())
        self._step_ended()
        return changed

    def _step_ended(self) -> None:
        if self.on_step_end is not None:
            self.on_step_end()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (
                    self._stopping or self._incoming or self._aborts or self.scheduler.has_work()
                ):
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except BaseException as exc:  # noqa: BLE001 - reported to every request, then stop
                log.exception("replica %d failed", self.index)
                self._fail_all(exc)
                return
            if not self._last_batch_size:
                # Waiting for blocks other replicas hold: nap until news or a short timeout.
                with self._cond:
                    self._cond.wait(timeout=BLOCKED_RETRY_S)

    def _fail_step(self, requests: list[Request], exc: Exception) -> None:
        """Fail the requests of a step whose model run raised; their blocks (the pending ones
        this step was writing included) go back to the pool, and the replica goes on."""
        log.exception("replica %d: a step of %d request(s) failed", self.index, len(requests))
        self.num_failed_steps += 1
        error = EngineStepError(f"the engine step failed ({type(exc).__name__}: {exc})")
        self.last_step_error = error
        for request in requests:
            self.scheduler.abort(request, "error")
            if self.on_output is not None:
                self.on_output(request, error)
        self._step_ended()

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            self.failed = exc
            stranded = self._incoming + self.scheduler.waiting + self.scheduler.running
            self._incoming = []
        for request in list(stranded):
            self.scheduler.abort(request, "error")
            if self.on_output is not None:
                self.on_output(request, exc)
        self._step_ended()
