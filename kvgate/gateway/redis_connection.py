"""One place that turns a Redis URL into a client, for every Redis user (discovery cache,
catalog pub/sub, budgets), so they agree on timeouts and on how production Redis is reached.

- ``redis://`` / ``rediss://`` (TLS): redis-py's own URL, ACL user and password included
  (``rediss://user:pass@host:6380/0?ssl_ca_certs=/ca.pem&ssl_certfile=…&ssl_keyfile=…``);
- ``redis+sentinel://[user:pass@]host:port,host:port/service[/db]`` (``rediss+sentinel`` for
  TLS): the master Sentinel names now, followed through failovers;
- ``redis+cluster://host:port`` (``rediss+cluster``): Redis Cluster, slots followed.

Pass secrets through ``KVGATE_REDIS_URL`` rather than a flag (flags show in process lists).
Calls are bounded by the timeouts and redis-py's own retries are off unless given: callers
fall back rather than wait.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

DEFAULT_TIMEOUT_S = 0.25
STOP_WAIT_S = 2.0

log = logging.getLogger(__name__)


def connect(url: str, **options: Any) -> Any:
    """A ``redis.asyncio`` client for ``url`` (same keyword options as ``from_url``)."""
    options.setdefault("socket_timeout", DEFAULT_TIMEOUT_S)
    options.setdefault("socket_connect_timeout", options["socket_timeout"])
    options.setdefault("retry", Retry(NoBackoff(), 0))
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"redis_url: {url!r} has no scheme")
    if scheme in ("redis+sentinel", "rediss+sentinel"):
        return _sentinel_master(rest, scheme.startswith("rediss"), options)
    if scheme in ("redis+cluster", "rediss+cluster"):
        base = scheme.split("+")[0]
        options.pop("retry")  # a cluster client retries by moving to the slot's new owner
        return RedisCluster.from_url(f"{base}://{rest}", **options)
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            f"redis_url: scheme {scheme!r} is not redis, rediss, unix, "
            "redis+sentinel, rediss+sentinel, redis+cluster or rediss+cluster"
        )
    return aioredis.from_url(url, **options)


def _sentinel_master(rest: str, tls: bool, options: dict[str, Any]) -> Any:
    parts = urlsplit("//" + rest)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    path = [p for p in parts.path.split("/") if p]
    if not hosts or not path:
        raise ValueError("redis_url: expected redis+sentinel://host:port[,host:port]/service[/db]")
    sentinels = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit():
            raise ValueError(f"redis_url: sentinel address {host!r} is not host:port")
        sentinels.append((name, int(port)))
    client: dict[str, Any] = {**options, **{k: v[0] for k, v in parse_qs(parts.query).items()}}
    if username:
        client["username"] = unquote(username)
    if password:
        client["password"] = unquote(password)
    if len(path) > 1:
        client["db"] = int(path[1])
    if tls:
        client["ssl"] = True
    sentinel_options = {
        k: v for k, v in client.items() if k not in ("db", "retry")
    }  # the same credentials and timeouts for the sentinels themselves
    # Older redis releases leave Sentinel untyped; 8.2 (installed 2026-12-05) types it.
    sentinel = Sentinel(sentinels, sentinel_kwargs=sentinel_options, **client)  # type: ignore[no-untyped-call, unused-ignore]
    return sentinel.master_for(unquote(path[0]))


async def stop_tasks(tasks: set[asyncio.Task[Any]], wait_s: float = STOP_WAIT_S) -> None:
    """Cancel ``tasks`` (Redis listeners and calls) and wait at most ``wait_s`` for them,
    cancelling those left once more. A listener cancelled while redis-py closed a pub/sub
    connection whose server had just died stayed "cancelling" for good, its close bounded by
    ``asyncio.wait_for``, which waits for what it cancels (seen under load: a worker's drain
    never ended); a second cancel interrupts that wait. A shutdown must end: one still left
    is logged and left to the exiting process."""
    pending = set(tasks)
    for _ in range(2):  # a second cancel interrupts a wait_for stuck on its first
        if not pending:
            return
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=wait_s / 2)
    for task in pending:
        log.warning(
            "%s did not stop within %.0f s of its cancel; leaving it", task.get_name(), wait_s
        )
