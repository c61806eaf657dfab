"""Every record kvgate reads back from Redis is read here: bounded, typed, then checked.

Redis is shared: whatever else can write to it may leave, under one of kvgate's keys, a value
that is not what kvgate wrote — not JSON, the wrong shape, another data type (a hash), or tens
of MiB. None of that may cost more than a "not found": no 500, no ``WRONGTYPE`` string in an
answer, no record pulled whole into the gateway's memory. So no record is fetched with a plain
``GET``:

1. one script (``READ``) answers with the value only when the key holds a string of at most
   ``limit`` bytes; ``TYPE`` and ``STRLEN`` are asked first, in Redis, so an oversized value
   never crosses the wire and another type is never a ``WRONGTYPE`` error. Scripts that read
   a record themselves (the placement records, the task store's guarded write) use the same
   Lua function, ``BOUNDED_GET``;
2. the bytes are parsed and handed to the record's own check (``RecordReader.read``), which
   raises ``ValueError``/``TypeError`` for anything it would not use (an entry that is not
   JSON is checked by its own reader, after ``RecordReader.raw``).

A record refused at either step reads exactly as a missing key, and is logged (the key and
why, once): the caller answers "not found" or rebuilds, as for an unknown key.

Tenant isolation. A record a tenant owns is addressed by its tenant as well as its id: its key
holds ``key_part(tenant)`` (stored responses), or the record holds the tenant and every read
compares it (tasks). Either way another tenant's id reads exactly as an unknown id — same
status, same body but for the id — because the lookup misses the same way. The objects a
tenant can name, and how each is scoped:

- stored responses (``previous_response_id``, ``/v1/responses/render``): the tag in the key,
  the tenant in the record, checked on read;
- tasks (``tasks/get``, ``tasks/cancel``, ``tasks/update``): the tenant in the record,
  checked on every read (``Tasks.get``); the live-task cap counts per tenant;
- cached prefixes: the engine's block hashes are rooted in the tenant's secret salt
  (``identity.tenant_salt``), so no prompt, ``cache_key`` or ``cache_salt`` reaches another
  tenant's blocks;
- placement records (fleet mode): keyed by the request's salted ``cache_salt`` as well as its
  routing key, so one tenant's ``cache_key`` never follows, refreshes or moves another's;
- LoRA adapters: one namespace served to every tenant, like the base model; only the
  operator (the admin credential, when authentication is on) loads or unloads them at run
  time, so no tenant changes what another's calls run.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import orjson

MAX_RECORD_BYTES = 8 << 20  # a 128k-token conversation is ~0.5 MB of text; past this is junk
MAX_TOLD = 1024  # keys whose problem was logged, remembered so that it is logged once
log = logging.getLogger("kvgate.redis")
T = TypeVar("T")

# bounded_get(key, limit): the string at ``key`` when it is one of at most ``limit`` bytes,
# else false and why ('none' for no key, the type's name, or 'size N').
BOUNDED_GET = """
local function bounded_get(key, limit)
  local kind = redis.call('TYPE', key)['ok']
  if kind ~= 'string' then return false, kind end
  local size = redis.call('STRLEN', key)
  if size > limit then return false, 'size ' .. size end
  return redis.call('GET', key), nil
end
"""
# KEYS[1] the record; ARGV[1] the most bytes it may have. The value, or {why}.
READ = (
    BOUNDED_GET
    + """
local value, why = bounded_get(KEYS[1], tonumber(ARGV[1]))
if value then return value end
return {why}
"""
)


def key_part(name: str) -> str:
    """The part of a Redis key that names a tenant ("" when authentication is off) or a
    cache salt: a hash, so any name makes a short key part."""
    return hashlib.sha256(name.encode()).hexdigest()[:32]


class RecordReader:
    """Bounded, checked reads of one Redis client's records (see the module)."""

    def __init__(self, client: Any) -> None:
        self._read = client.register_script(READ)
        self._told: set[tuple[str, str]] = set()  # (key, why) already logged

    async def raw(self, key: str, limit: int = MAX_RECORD_BYTES) -> bytes | None:
        """The value at ``key`` if it is a string of at most ``limit`` bytes, else None
        (logged unless there is no key). Redis failures raise, as the client's calls do."""
        answer = await self._read(keys=[key], args=[limit])
        if isinstance(answer, bytes):
            return answer
        why = answer[0].decode("ascii", "replace") if answer else "no answer"
        if why != "none":
            self._unusable(key, why)
        return None

    async def read(
        self, key: str, check: Callable[[Any], T], limit: int = MAX_RECORD_BYTES
    ) -> T | None:
        """``check`` of the JSON at ``key``; None when there is none or it is unusable
        (not JSON, or ``check`` raises ``ValueError`` or ``TypeError``)."""
        raw = await self.raw(key, limit)
        if raw is None:
            return None
        try:
            return check(orjson.loads(raw))
        except (TypeError, ValueError) as exc:  # orjson.JSONDecodeError is a ValueError
            self._unusable(key, str(exc)[:200])
            return None

    def _unusable(self, key: str, why: str) -> None:
        """One log line per key and reason (a client polling a bad key adds none)."""
        if (key, why) in self._told:
            return
        if len(self._told) >= MAX_TOLD:
            self._told.clear()
        self._told.add((key, why))
        log.warning("Redis record %s is unusable (%s): read as absent", key[:200], why)
