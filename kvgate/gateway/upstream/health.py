"""One upstream's health: a circuit breaker fed by calls (passive) and by checks (active).

Consecutive failures of either kind — connection refused or reset, a 5xx other than an
overload answer, a timeout — open the breaker: routing skips the upstream. A successful
active check closes it again; without active checks an open breaker lets calls through as
trials once ``cooldown_s`` has passed (one failed trial re-opens it for another cooldown).
A 429/503 is an overloaded upstream, not a broken one: it is retried elsewhere but does not
open the breaker.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Breaker:
    def __init__(
        self,
        unhealthy_after: int,
        healthy_after: int,
        cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if unhealthy_after < 1 or healthy_after < 1:
            raise ValueError("upstream_unhealthy_after and upstream_healthy_after must be >= 1")
        self.unhealthy_after = unhealthy_after
        self.healthy_after = healthy_after
        self.cooldown_s = cooldown_s
        self._clock = clock
        self.healthy = True
        self.last_error: str | None = None
        self._failures = 0
        self._successes = 0
        self._trial_at = 0.0

    @property
    def state(self) -> str:
        if self.healthy:
            return "healthy"
        return "half_open" if self._clock() >= self._trial_at else "unhealthy"

    def available(self) -> bool:
        """May a call be routed here now (healthy, or open long enough for a trial)?"""
        return self.healthy or self._clock() >= self._trial_at

    def failure(self, kind: str) -> None:
        self.last_error = kind
        self._failures += 1
        self._successes = 0
        if not self.healthy or self._failures >= self.unhealthy_after:
            self.healthy = False
            self._trial_at = self._clock() + self.cooldown_s

    def success(self) -> None:
        self._failures = 0
        if self.healthy:
            return
        self._successes += 1
        if self._successes >= self.healthy_after:
            self.healthy = True
            self.last_error = None
