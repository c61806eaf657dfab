"""One engine replica: a scheduler and a runner, stepped by its own thread or by hand.

Other threads talk to a replica only through ``submit`` and ``abort``, which queue work under
a condition variable; the step loop picks it up at the next step boundary and sleeps on the
condition when there is nothing to do (no busy spinning).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput
from engine.request import Request
from engine.scheduler import Scheduler
from engine.stats import ReplicaStats

log = logging.getLogger(__name__)

BLOCKED_RETRY_S = 0.005
# Called from the step thread with each request that has news (or the step's exception).
OutputSink = Callable[[Request, "RequestOutput | BaseException"], None]


class Replica:
    def __init__(
        self,
        index: int,
        scheduler: Scheduler,
        runner: ModelRunner,
        on_output: OutputSink | None = None,
    ):
        self.index = index
        self.scheduler = scheduler
        self.runner = runner
        self.on_output = on_output
        self.failed: BaseException | None = None
        self._cond = threading.Condition()
        self._incoming: list[Request] = []
        self._aborts: list[Request] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._last_batch_size = 0

    # -- called from any thread --------------------------------------------------------------

    def submit(self, request: Request) -> None:
        request.replica = self.index
        with self._cond:
            self._incoming.append(request)
            self._cond.notify()

    def abort(self, request: Request) -> None:
        """Stop a request; its blocks are freed at the next step boundary."""
        with self._cond:
            self._aborts.append(request)
            self._cond.notify()

    @property
    def load(self) -> int:
        """Requests this replica holds: queued, waiting and running."""
        with self._cond:
            queued = len(self._incoming)
        return queued + len(self.scheduler.waiting) + len(self.scheduler.running)

    @property
    def available(self) -> bool:
        return self.failed is None and (self._thread is None or self._thread.is_alive())

    def stats(self) -> ReplicaStats:
        kv = self.scheduler.kv
        with self._cond:
            queued = len(self._incoming)
        return ReplicaStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting) + queued,
            kv_usage=kv.pool.num_held(self.index) / (kv.pool.num_blocks - 1),
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
        for request in aborts:
            if not request.finished:
                self.scheduler.abort(request)
        batch = self.scheduler.schedule()
        self._last_batch_size = len(batch)
        if not batch:
            return []
        sampled = self.runner.execute(batch)
        changed = self.scheduler.update(batch, sampled)
        if self.on_output is not None:
            for request in changed:
                self.on_output(request, request.take_output())
        return changed

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
                self.failed = exc
                self._fail_all(exc)
                return
            if not self._last_batch_size:
                # Waiting for blocks other replicas hold: nap until news or a short timeout.
                with self._cond:
                    self._cond.wait(timeout=BLOCKED_RETRY_S)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            stranded = self._incoming + self.scheduler.waiting + self.scheduler.running
            self._incoming = []
        for request in list(stranded):
            self.scheduler.abort(request)
            if self.on_output is not None:
                self.on_output(request, exc)
