"""A sum whose parts fade with their age: "lately" for the routing costs' counts (blocks an
upstream evicted, prompt tokens sent to it), in O(1) memory, with no window of samples."""

from __future__ import annotations

import math


class DecayingSum:
    """Each part added weighs ``exp(-age / time_constant)`` of itself at ``now``; the sum
    is kept as one value and the time it was last brought up to date. Time never runs back:
    an earlier ``now`` reads as the last one."""

    __slots__ = ("time_constant", "_value", "_at")

    def __init__(self, time_constant: float) -> None:
        self.time_constant = time_constant
        self._value = 0.0
        self._at = 0.0

    @classmethod
    def with_half_life(cls, half_life: float) -> DecayingSum:
        return cls(half_life / math.log(2))

    def add(self, amount: float, now: float) -> None:
        self._value = self.value(now) + amount
        self._at = max(self._at, now)

    def value(self, now: float) -> float:
        return self._value * math.exp(-max(0.0, now - self._at) / self.time_constant)

    def clear(self) -> None:
        self._value = 0.0
