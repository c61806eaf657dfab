"""The Tasks extension on one live kvgate (embedded tiny engine, in-process task store), over
the real wire: JSON-RPC over Streamable HTTP with httpx, every message validated against the
spec's and the extension's ``schema.json`` (``tests/gateway/tasks/client.py``)."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Iterator

import httpx
import pytest

from kvgate.engine import AsyncLLM
from kvgate.protocol.tasks import TASKS_EXTENSION
from tests.gateway.live_server import LiveServer
from tests.gateway.tasks.client import TASK_HINT, generate, poll_until, task_call
from tests.gateway.wire import call, legacy, modern_headers

SHORT = {"prompt": "Once upon a time", "max_tokens": 24}
LONG = {"prompt": "A long story", "max_tokens": 3000}  # never ends early at temperature 0


@pytest.fixture(scope="module")
def live(engine: AsyncLLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    keys = tmp_path_factory.mktemp("keys") / "keys"
    keys.write_text(
        "".join(f"{t}: {hashlib.sha256(k.encode()).hexdigest()}\n" for t, k in TENANTS.items())
    )
    with LiveServer(
        engine,
        api_keys_file=str(keys),
        task_threshold_s=2.0,
        task_poll_interval_s=0.2,
        max_tasks_per_tenant=2,
    ) as server:
        yield server


TENANTS = {"acme": "acme-key", "globex": "globex-key"}
A, B = TENANTS["acme"], TENANTS["globex"]


@pytest.fixture
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as client:
        yield client


def running_requests(live: LiveServer) -> float:
    text = httpx.get(live.base + "/metrics").text
    return float(re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M)[1])


def test_discover_advertises_the_extension(http: httpx.Client, live: LiveServer) -> None:
    result = call(http, live.url, "server/discover", headers={"Authorization": f"Bearer {A}"})
    assert result.result["capabilities"]["extensions"] == {TASKS_EXTENSION: {}}


def test_a_declared_call_with_the_hint_is_a_task_whose_result_is_the_direct_one(
    http: httpx.Client, live: LiveServer
) -> None:
    direct = generate(http, live.url, SHORT, declared=False, key=A).result
    assert direct["resultType"] == "complete" and not direct["isError"]
    created = generate(http, live.url, SHORT, meta=TASK_HINT, key=A).result
    assert created["resultType"] == "task" and created["status"] == "working"
    assert created["ttlMs"] > 0 and created["pollIntervalMs"] == 200
    http.close()  # the client goes away right after CreateTaskResult: the work goes on
    with httpx.Client(timeout=30) as later:
        done = poll_until(later, live.url, created["taskId"], ("completed",), key=A)
    assert done["resultType"] == "complete"
    assert done["result"]["content"] == direct["content"]
    assert done["result"]["structuredContent"]["text"] == direct["structuredContent"]["text"]
    assert done["createdAt"] == created["createdAt"]


def test_the_threshold_decides_for_a_declared_call_and_never_for_an_undeclared_one(
    http: httpx.Client, live: LiveServer
) -> None:
    short = generate(http, live.url, {"prompt": "Hi", "max_tokens": 2}, key=A).result
    assert short["resultType"] == "complete"
    # 3000 tokens at the tiny model's observed rate is well past 2 s: a task
    long = generate(http, live.url, LONG, key=A).result
    assert long["resultType"] == "task"
    task_call(http, live.url, "tasks/cancel", long["taskId"], key=A)
    opted_out = generate(
        http, live.url, {**LONG, "max_tokens": 40}, meta={"dev.kvgate/task": False}, key=A
    ).result
    assert opted_out["resultType"] == "complete"
    undeclared = generate(http, live.url, {**LONG, "max_tokens": 40}, declared=False, key=A).result
    assert undeclared["resultType"] == "complete"  # as before the extension existed
    poll_until(http, live.url, long["taskId"], ("cancelled",), key=A)


def test_a_task_asked_for_without_the_capability_is_32021(
    http: httpx.Client, live: LiveServer
) -> None:
    refused = generate(http, live.url, SHORT, declared=False, meta=TASK_HINT, key=A)
    assert refused.status == 400 and refused.error["code"] == -32021
    assert refused.error["data"] == {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}}
    created = generate(http, live.url, SHORT, meta=TASK_HINT, key=A).result
    undeclared = task_call(http, live.url, "tasks/get", created["taskId"], key=A, declared=False)
    assert undeclared.error["code"] == -32021
    bad_hint = generate(http, live.url, SHORT, meta={"dev.kvgate/task": "yes"}, key=A)
    assert bad_hint.error["code"] == -32602 and "dev.kvgate/task" in bad_hint.error["message"]
    poll_until(http, live.url, created["taskId"], ("completed",), key=A)


def test_task_notifications_need_the_capability(http: httpx.Client, live: LiveServer) -> None:
    auth = {"Authorization": f"Bearer {A}"}
    params = {"notifications": {"taskIds": ["x" * 32]}}
    refused = call(http, live.url, "subscriptions/listen", params, headers=auth)
    assert refused.status == 400 and refused.error["code"] == -32021


def test_legacy_clients_never_see_tasks(http: httpx.Client, live: LiveServer) -> None:
    auth = {"Authorization": f"Bearer {A}"}
    arguments = {**LONG, "max_tokens": 40, "temperature": 0}
    answer = legacy(
        http, live.url, "tools/call", {"name": "generate", "arguments": arguments}, headers=auth
    )
    assert "resultType" not in answer.result and not answer.result["isError"]
    unknown = legacy(http, live.url, "tasks/get", {"taskId": "x" * 32}, headers=auth)
    assert unknown.error["code"] == -32601


def test_task_methods_carry_the_task_id_in_mcp_name(http: httpx.Client, live: LiveServer) -> None:
    created = generate(http, live.url, SHORT, meta=TASK_HINT, key=A).result
    mismatch = call(
        http,
        live.url,
        "tasks/get",
        {"taskId": created["taskId"]},
        headers={**modern_headers("tasks/get", "someone-else"), "Authorization": f"Bearer {A}"},
    )
    assert mismatch.status == 400 and mismatch.error["code"] == -32020
    poll_until(http, live.url, created["taskId"], ("completed",), key=A)


def test_another_tenant_cannot_see_or_cancel_a_task(http: httpx.Client, live: LiveServer) -> None:
    created = generate(http, live.url, LONG, meta=TASK_HINT, key=A).result
    unknown = task_call(http, live.url, "tasks/get", "x" * 32, key=B).error
    for method in ("tasks/get", "tasks/cancel"):
        other = task_call(http, live.url, method, created["taskId"], key=B).error
        assert other == unknown  # the same words as an id that never existed: no leak
        assert other["code"] == -32602
    assert task_call(http, live.url, "tasks/get", created["taskId"], key=A).result
    task_call(http, live.url, "tasks/cancel", created["taskId"], key=A)
    poll_until(http, live.url, created["taskId"], ("cancelled",), key=A)


def test_cancel_stops_the_generation_and_frees_the_engine(
    http: httpx.Client, live: LiveServer
) -> None:
    created = generate(http, live.url, LONG, meta=TASK_HINT, key=A).result
    working = poll_until(http, live.url, created["taskId"], ("working",), key=A)
    assert re.fullmatch(r"\d+ tokens generated so far", working["statusMessage"])
    ack = task_call(http, live.url, "tasks/cancel", created["taskId"], key=A).result
    assert ack["resultType"] == "complete"
    cancelled = poll_until(http, live.url, created["taskId"], ("cancelled",), key=A)
    assert "result" not in cancelled
    deadline = time.monotonic() + 5
    while running_requests(live) != 0:
        assert time.monotonic() < deadline, "the cancelled generation still runs"
        time.sleep(0.02)
    again = task_call(http, live.url, "tasks/cancel", created["taskId"], key=A).result
    assert again["resultType"] == "complete"  # a terminal task: nothing to do, acknowledged


def test_update_has_nothing_outstanding_and_is_acknowledged(
    http: httpx.Client, live: LiveServer
) -> None:
    created = generate(http, live.url, SHORT, meta=TASK_HINT, key=A).result
    task_id = created["taskId"]
    responses = {"name": {"action": "accept", "content": {"x": 1}}}
    ack = task_call(http, live.url, "tasks/update", task_id, key=A, inputResponses=responses)
    assert ack.result["resultType"] == "complete"
    bad = task_call(http, live.url, "tasks/update", task_id, key=A, inputResponses=[])
    assert bad.error["code"] == -32602 and "inputResponses" in bad.error["message"]
    missing = task_call(http, live.url, "tasks/update", "y" * 32, key=A, inputResponses={})
    assert missing.error["code"] == -32602
    poll_until(http, live.url, task_id, ("completed",), key=A)


def test_the_per_tenant_cap_on_live_tasks(http: httpx.Client, live: LiveServer) -> None:
    first, second = (generate(http, live.url, LONG, meta=TASK_HINT, key=A).result for _ in "12")
    refused = generate(http, live.url, LONG, meta=TASK_HINT, key=A)
    assert refused.status == 429 and refused.error["code"] == -31001
    assert "--max-tasks-per-tenant" in refused.error["message"]
    other = generate(http, live.url, SHORT, meta=TASK_HINT, key=B).result  # its own cap
    for task in (first, second):
        task_call(http, live.url, "tasks/cancel", task["taskId"], key=A)
        poll_until(http, live.url, task["taskId"], ("cancelled",), key=A)
    poll_until(http, live.url, other["taskId"], ("completed",), key=B)
    deadline = time.monotonic() + 5
    while running_requests(live) != 0:  # the refused call's generation was never started
        assert time.monotonic() < deadline, "a generation still runs"
        time.sleep(0.02)
    metrics = httpx.get(live.base + "/metrics").text
    assert re.search(r'^kvgate_tasks_total\{state="cancelled"\} [1-9]', metrics, re.M)
    assert re.search(
        r'^kvgate_task_duration_seconds_count\{state="completed"\} [1-9]', metrics, re.M
    )


def test_unknown_ids_are_not_found(http: httpx.Client, live: LiveServer) -> None:
    for task_id in ("nope", "z" * 40, "../../etc"):
        error = task_call(http, live.url, "tasks/get", task_id, key=A).error
        assert error["code"] == -32602 and error["message"].endswith("Task not found")
