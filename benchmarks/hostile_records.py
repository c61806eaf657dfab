"""The hostile records of ``benchmarks.hostile``'s ``records`` case (issue 44): 24 MiB values
left in Redis under the keys kvgate reads back — a stored response of the attacker tenant's
(valid JSON: ~800k short messages, what a parser would turn into hundreds of MiB), a task, and
a response key holding a hash — and the callers that make the gateway read them."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx
import orjson
import redis

from benchmarks.hostile_tools import KEYS
from kvgate.gateway.openai.response_store import key_of
from kvgate.protocol.modern import CLIENT_CAPABILITIES_KEY
from kvgate.protocol.tasks import TASKS_EXTENSION
from tests.gateway.wire import modern_headers, modern_meta

RECORD_MIB = 24
TENANT = "key:attacker"  # the tenant the attacker's API key proves


def plant(redis_url: str, mib: int = RECORD_MIB) -> dict[str, str]:
    """Write the records; the id each kind of call names."""
    message = {"role": "user", "content": "hi"}
    many = [message] * ((mib << 20) // len(orjson.dumps(message)))
    ids = {"response": f"resp_{uuid.uuid4().hex}", "hash": f"resp_{uuid.uuid4().hex}"}
    ids["task"] = uuid.uuid4().hex
    response = {"tenant": TENANT, "response": {}, "messages": many}
    task = {"id": ids["task"], "tenant": TENANT, "status": "completed", "result": {"m": many}}
    with redis.Redis.from_url(redis_url) as client:
        client.set(key_of(TENANT, ids["response"]), orjson.dumps(response), ex=3600)
        client.hset(key_of(TENANT, ids["hash"]), mapping={"messages": "a hash"})
        client.set(f"kvgate:task:{ids['task']}", orjson.dumps(task), ex=3600)
    return ids


def record_calls(base: str, kind: str, record_id: str, seconds: float) -> dict[str, int]:
    """Calls naming ``record_id`` for ``seconds`` as the attacker: a continued response
    (``response``, ``hash``), its render (``render``) or ``tasks/get`` (``task``); how many
    came back with each status (and JSON-RPC error code)."""
    auth = {"Authorization": f"Bearer {KEYS['attacker']}", "Content-Type": "application/json"}
    body: dict[str, Any] = {"input": "Go on.", "previous_response_id": record_id}
    path, headers = "/v1/responses", auth
    if kind == "render":
        path = "/v1/responses/render"
    elif kind == "task":
        meta = modern_meta(**{CLIENT_CAPABILITIES_KEY: {"extensions": {TASKS_EXTENSION: {}}}})
        params = {"taskId": record_id, "_meta": meta}
        body = {"jsonrpc": "2.0", "id": 1, "method": "tasks/get", "params": params}
        path, headers = "/mcp", {**auth, **modern_headers("tasks/get", record_id)}
    outcomes: dict[str, int] = {}
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=base, timeout=30) as http:
        while time.monotonic() < deadline and sum(outcomes.values()) < 100_000:
            response = http.post(path, content=orjson.dumps(body), headers=headers)
            code = ""
            if kind == "task":  # a JSON-RPC error, or a result
                code = f" {(response.json().get('error') or {}).get('code', 'result')}"
            outcome = f"{response.status_code}{code}"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    return outcomes
