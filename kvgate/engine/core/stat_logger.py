"""A periodic log line of what the engine is doing, worded as vLLM's ``LoggingStatLogger``::

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 95.1 tokens/s,
    Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 61.0%

(one line), so whoever reads or parses vLLM's logs reads kvgate's. It comes every
``stats_interval_s`` while the engine has work or did some in the interval, and never while it
is idle. Prompt throughput counts the prompt tokens computed (cached ones are not), as vLLM's
does; the hit rate is that of the prompts looked up in the interval (the last one known when
none were). It is written where the engine runs, so ``--workers N`` API processes make one
line, not N.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvgate.engine.stats import EngineStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Totals:
    at: float
    computed_prompt: int
    generated: int
    preemptions: int
    prefix_queries: int
    prefix_hits: int

    @classmethod
    def of(cls, stats: EngineStats, at: float) -> _Totals:
        serving = stats.serving
        return cls(
            at,
            serving.prompt_tokens - serving.cached_prompt_tokens,
            serving.generation_tokens,
            serving.preemptions,
            stats.prefix_queries,
            stats.prefix_hits,
        )


def started(stats: Callable[[], EngineStats], interval_s: float) -> StatLogger | None:
    """A running StatLogger; None when ``interval_s`` is 0 (no stats line)."""
    if interval_s <= 0:
        return None
    logger = StatLogger(stats, interval_s)
    logger.start()
    return logger


class StatLogger:
    """Reads ``stats()`` every ``interval_s`` on a thread of its own and logs the line."""

    def __init__(self, stats: Callable[[], EngineStats], interval_s: float) -> None:
        self._stats, self.interval_s = stats, interval_s
        self._last = _Totals.of(stats(), time.monotonic())
        self._hit_rate: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvgate-stats", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            line = self.line()
            if line is not None:
                log.info("%s", line)

    def line(self) -> str | None:
        """The line for the interval since the previous call; None when it was idle."""
        stats = self._stats()
        now = _Totals.of(stats, time.monotonic())
        last, self._last = self._last, now
        seconds = max(now.at - last.at, 1e-9)
        prompt, generated = (
            now.computed_prompt - last.computed_prompt,
            now.generated - last.generated,
        )
        if not (prompt or generated or stats.num_running or stats.num_waiting):
            return None
        queries = now.prefix_queries - last.prefix_queries
        if queries:
            self._hit_rate = (now.prefix_hits - last.prefix_hits) / queries
        parts = [
            f"Avg prompt throughput: {prompt / seconds:.1f} tokens/s",
            f"Avg generation throughput: {generated / seconds:.1f} tokens/s",
            f"Running: {stats.num_running} reqs",
            f"Waiting: {stats.num_waiting} reqs",
        ]
        if now.preemptions > last.preemptions:
            parts.append(f"Preemptions: {now.preemptions - last.preemptions}")
        parts.append(f"KV cache usage: {stats.kv_usage * 100:.1f}%")
        if self._hit_rate is not None:
            parts.append(f"Prefix cache hit rate: {self._hit_rate * 100:.1f}%")
        return ", ".join(parts)
