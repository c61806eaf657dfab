"""The extension's methods, ``tasks/get``, ``tasks/update`` and ``tasks/cancel``, as results.

Each is answered for the caller's tenant only (another tenant's task is "not found", the same
words as an unknown id), and only to a request that declares the extension (−32021 otherwise,
as the extension says). kvgate's tasks never ask the client for input, so ``tasks/update``
has nothing outstanding to answer: its responses are ignored, as the extension says of keys
not outstanding, and it is acknowledged.
"""

from __future__ import annotations

from typing import Any

from kvgate.gateway.auth.identity import current_tenant
from kvgate.gateway.tasks.tasks import Tasks
from kvgate.protocol.errors import invalid_params
from kvgate.protocol.jsonrpc_types import Message
from kvgate.protocol.tasks import (
    acknowledgement,
    declares_tasks,
    get_task_result,
    missing_tasks_capability,
    task_id_of,
)


async def answer(tasks: Tasks, message: Message, server_info: dict[str, Any]) -> dict[str, Any]:
    if not declares_tasks(message.meta):
        raise missing_tasks_capability(
            f"{message.method} needs the io.modelcontextprotocol/tasks extension declared in "
            "params._meta client capabilities"
        )
    task_id = task_id_of(message.params)
    if message.method == "tasks/get":
        record = await tasks.get(task_id, current_tenant())
        return get_task_result(record.view(), server_info)
    if message.method == "tasks/cancel":
        await tasks.cancel(task_id, current_tenant())
        return acknowledgement(server_info)
    if not isinstance(message.params.get("inputResponses"), dict):  # tasks/update
        raise invalid_params("params.inputResponses must be an object")
    await tasks.get(task_id, current_tenant())  # an unknown task is an error here too
    return acknowledgement(server_info)
