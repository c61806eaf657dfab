"""One place that turns a Redis URL and the TLS/ACL options into a client.

Every Redis user (discovery cache, catalog pub/sub, budgets) calls ``connect`` so they
agree on timeouts and on how production Redis is reached. Calls are bounded by
``timeout_s`` and redis-py's own retries are off: callers fall back rather than wait.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff


def connect(url: str, timeout_s: float, **options: Any) -> aioredis.Redis:
    return aioredis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        **options,
    )
