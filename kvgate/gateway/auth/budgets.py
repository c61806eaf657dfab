"""Per-tenant budgets shared by every process: requests/min and tokens/min token buckets.

Each bucket holds up to one minute's budget and refills continuously. One Lua script refills
and checks every bucket a call touches and debits them only if all allow it, atomically in
Redis, on Redis's own clock — so N gateway processes together allow 1x the budget. A call is
admitted while its tenant has a request left and a positive token balance; tokens (completion
as they are produced, then the prompt) are debited afterwards and may run the balance into
debt, so a budget is overshot by at most the calls already running. ``Retry-After`` is when
the bucket will allow the call. Without a shared store — no Redis configured, or Redis
unreachable — each process enforces ``budget/N`` locally (``N`` = ``budget_processes``, which
``--workers`` multiplies), so N processes together still allow 1x the budget; a share always
holds at least one call, so a budget below N admits one call per process at a time rather
than none ever. An outage is logged once, and Redis is used again when it answers (probed at
most once a second).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from dataclasses import dataclass

from redis.exceptions import RedisError

from kvgate.gateway.calls.errors import Refused
from kvgate.gateway.redis_connection import connect

log = logging.getLogger("kvgate.auth")
REDIS_FAILURES = (RedisError, OSError, asyncio.TimeoutError)
PROBE_EVERY_S = 1.0
NO_NEED = -1e300  # a debit that is always allowed

# KEYS: buckets. ARGV: 4 per bucket (capacity, refill per ms, cost, need). Returns the wait in
# ms until every bucket holds its need (0: allowed, and every cost was debited). A bucket that
# is not a hash, or holds no number, NaN, more than its capacity, a debt beyond any real one
# (1e12) or a time ahead of Redis's own (written by anything but this script) starts full and
# now: never an error, never a bypass.
TAKE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local levels, wait = {}, 0
for i, key in ipairs(KEYS) do
  local b = (i - 1) * 4
  local capacity, rate, need = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 4])
  if redis.call('TYPE', key).ok ~= 'hash' then redis.call('DEL', key) end
  local state = redis.call('HMGET', key, 'level', 'at')
  local level, at = tonumber(state[1]), tonumber(state[2])
  if not level or not (level <= capacity and level >= -1e12) then level = capacity end
  if not at or not (at <= now and at >= 0) then at = now end
  level = math.min(capacity, level + math.max(0, now - at) * rate)
  levels[i] = level
  if level < need then wait = math.max(wait, math.ceil((need - level) / rate)) end
end
for i, key in ipairs(KEYS) do
  local b = (i - 1) * 4
  local capacity, rate, cost = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
  local level = levels[i]
  if wait == 0 then level = level - cost end
  redis.call('HSET', key, 'level', level, 'at', now)
  redis.call('PEXPIRE', key, math.ceil((capacity - level) / rate) + 1000)
end
return wait
"""


@dataclass(frozen=True)
class Take:
    key: str
    capacity: float
    rate_per_ms: float
    cost: float
    need: float

    def args(self) -> list[float]:
        return [self.capacity, self.rate_per_ms, self.cost, self.need]


class LocalBuckets:
    """The same buckets in this process alone (the fallback while Redis is away)."""

    def __init__(self) -> None:
        self._levels: dict[str, tuple[float, float]] = {}  # key -> (level, at ms)

    def take(self, takes: list[Take]) -> float:
        now = time.monotonic() * 1000
        levels, wait = [], 0.0
        for t in takes:
            level, at = self._levels.get(t.key, (t.capacity, now))
            level = min(t.capacity, level + max(0.0, now - at) * t.rate_per_ms)
            levels.append(level)
            if level < t.need:
                wait = max(wait, math.ceil((t.need - level) / t.rate_per_ms))
        for t, level in zip(takes, levels, strict=True):
            self._levels[t.key] = (level - t.cost if wait == 0 else level, now)
        return wait


class Budgets:
    def __init__(
        self,
        requests_per_min: int,
        tokens_per_min: int,
        redis_url: str | None,
        processes: int = 1,
        timeout_s: float = 0.25,
    ) -> None:
        self.requests_per_min = requests_per_min
        self.tokens_per_min = tokens_per_min
        self.processes = max(1, processes)
        self.timeout_s = timeout_s
        self._redis = connect(redis_url, socket_timeout=timeout_s) if redis_url else None
        self._script = self._redis.register_script(TAKE) if self._redis else None
        self._local = LocalBuckets()
        self._down_since: float | None = None  # monotonic time of the last failed Redis call
        self._pending: set[asyncio.Task[float]] = set()

    def __bool__(self) -> bool:
        return bool(self.requests_per_min or self.tokens_per_min)

    @property
    def degraded(self) -> bool:
        return self._down_since is not None

    async def admit(self, tenant: str) -> None:
        """Take one request for ``tenant``; Refused (429 + Retry-After) if its budget is spent."""
        takes = []
        if self.requests_per_min:
            takes.append(self._take(tenant, "requests", self.requests_per_min, 1, 1))
        if self.tokens_per_min:
            takes.append(self._take(tenant, "tokens", self.tokens_per_min, 0, 1))
        if not takes:
            return
        wait_ms = await self._run(takes)
        if wait_ms > 0:
            raise Refused(
                429, "tenant_budget", "This tenant's budget is spent for now", wait_ms / 1000
            )

    def charge(self, tenant: str, tokens: int) -> None:
        """Debit ``tokens`` from ``tenant`` (in the background: the stream never waits)."""
        if not self.tokens_per_min or tokens <= 0:
            return
        take = self._take(tenant, "tokens", self.tokens_per_min, tokens, NO_NEED)
        task = asyncio.get_running_loop().create_task(self._run([take]))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def settle(self, tenant: str, tokens: int) -> None:
        """Debit ``tokens`` from ``tenant`` now (a call's last ones, before its answer goes)."""
        if self.tokens_per_min and tokens > 0:
            await self._run([self._take(tenant, "tokens", self.tokens_per_min, tokens, NO_NEED)])

    async def close(self) -> None:
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        if self._redis is not None:
            await self._redis.aclose()

    def _take(self, tenant: str, kind: str, per_min: int, cost: float, need: float) -> Take:
        name = hashlib.sha256(tenant.encode()).hexdigest()[:32]
        return Take(f"kvgate:budget:{{{name}}}:{kind}", per_min, per_min / 60_000, cost, need)

    async def _run(self, takes: list[Take]) -> float:
        if self._script is not None and self._redis_worth_trying():
            keys = [t.key for t in takes]
            args = [a for t in takes for a in t.args()]
            try:
                wait = await asyncio.wait_for(self._script(keys, args), self.timeout_s)
            except REDIS_FAILURES as exc:
                if self._down_since is None:
                    log.warning(
                        "budgets: Redis unreachable (%s); enforcing budget/%d in this process",
                        exc or type(exc).__name__,
                        self.processes,
                    )
                self._down_since = time.monotonic()
            else:
                if self._down_since is not None:
                    log.warning("budgets: Redis reachable again; budgets shared again")
                    self._down_since = None
                return float(wait)
        return self._local.take([_share(t, self.processes) for t in takes])

    def _redis_worth_trying(self) -> bool:
        return self._down_since is None or time.monotonic() - self._down_since >= PROBE_EVERY_S


def _share(take: Take, n: int) -> Take:
    """This process's 1/n of a bucket, holding at least one (a call's need): a share below it
    would never admit anything."""
    capacity = max(take.capacity / n, 1.0)
    return Take(take.key, capacity, take.rate_per_ms / n, take.cost, take.need)
