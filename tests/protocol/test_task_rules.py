"""The Tasks extension's pure rules, checked against the extension's own schema."""

from __future__ import annotations

import pytest

from kvgate.protocol.errors import ProtocolError
from kvgate.protocol.methods import NAME_BEARING, TASK_METHODS, check_method
from kvgate.protocol.tasks import (
    TASKS_EXTENSION,
    TaskView,
    check_listen_filter,
    create_task_result,
    declares_tasks,
    get_task_result,
    iso_time,
    missing_tasks_capability,
    task_id_of,
)
from kvgate.protocol.versions import Era
from kvgate.schemas.mcp_wire import TASKS_WIRE, validator

CAPS = "io.modelcontextprotocol/clientCapabilities"
INFO = {"name": "kvgate", "version": "1"}


def view(status: str, **extra: object) -> TaskView:
    now = iso_time(1_764_633_600_123)
    return TaskView("a" * 32, status, now, now, 60_000, 500, **extra)  # type: ignore[arg-type]


def test_only_a_request_that_declares_the_extension_may_get_a_task() -> None:
    assert declares_tasks({CAPS: {"extensions": {TASKS_EXTENSION: {}}}})
    for meta in ({}, {CAPS: {}}, {CAPS: {"extensions": {}}}, {CAPS: {"extensions": []}}):
        assert not declares_tasks(meta)
    assert not declares_tasks({CAPS: {"extensions": {TASKS_EXTENSION: True}}})


def test_task_methods_are_modern_only_and_carry_the_task_id_in_mcp_name() -> None:
    for method in TASK_METHODS:
        check_method(method, Era.MODERN)
        assert NAME_BEARING[method] == "taskId"
        with pytest.raises(ProtocolError) as legacy:
            check_method(method, Era.LEGACY)
        assert legacy.value.code == -32601


def test_the_missing_capability_error_names_the_extension() -> None:
    error = missing_tasks_capability("why").to_error()
    assert error["code"] == -32021
    assert error["data"] == {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}}


def test_task_notifications_need_the_capability() -> None:
    declared = {CAPS: {"extensions": {TASKS_EXTENSION: {}}}}
    check_listen_filter({"taskIds": ["a"]}, declared)
    check_listen_filter({"toolsListChanged": True}, {})
    with pytest.raises(ProtocolError) as refused:
        check_listen_filter({"taskIds": []}, {})
    assert refused.value.code == -32021


def test_task_ids_that_cannot_be_minted_here_are_not_found() -> None:
    assert task_id_of({"taskId": "p1." + "a" * 32}) == "p1." + "a" * 32
    with pytest.raises(ProtocolError) as not_string:
        task_id_of({"taskId": 7})
    assert not_string.value.code == -32602 and "taskId" in not_string.value.message
    for bad in ("short", "a" * 200, "../" + "a" * 20, "a b" * 10, "x:" + "a" * 20):
        with pytest.raises(ProtocolError, match="Task not found"):
            task_id_of({"taskId": bad})


@pytest.mark.parametrize(
    ("status", "extra"),
    [
        ("working", {"status_message": "3 tokens generated so far"}),
        ("completed", {"result": {"content": [{"type": "text", "text": "hi"}], "isError": False}}),
        ("failed", {"error": {"code": -32603, "message": "gone"}, "status_message": "gone"}),
        ("cancelled", {}),
    ],
)
def test_results_match_the_extension_schema(status: str, extra: dict[str, object]) -> None:
    task = view(status, **extra)
    got = get_task_result(task, INFO)
    validator(TASKS_WIRE, "GetTaskResult").validate(got)
    assert got["resultType"] == "complete" and got["createdAt"].endswith(".123Z")
    if status == "working":
        created = create_task_result(task, INFO)
        validator(TASKS_WIRE, "CreateTaskResult").validate(created)
        assert created["resultType"] == "task"
