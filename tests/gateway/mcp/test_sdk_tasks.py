"""The official MCP Python SDK (mcp==2.3.0) drives the Tasks extension: a ``ClientExtension``
advertises ``io.modelcontextprotocol/tasks`` and claims ``resultType: "task"``; its resolver
polls ``tasks/get`` (the SDK mirrors ``taskId`` into ``Mcp-Name``) until the task ends, so
``call_tool`` returns the generation's ``CallToolResult`` as if it had been answered directly."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import pytest
from mcp import Client
from mcp.client.extension import ClaimContext, ClientExtension, ResultClaim
from mcp_types import CallToolResult, Request, RequestParams, Result
from pydantic import ConfigDict

from kvgate.engine import AsyncLLM
from kvgate.protocol.tasks import TASKS_EXTENSION
from tests.gateway.live_server import LiveServer


class CreatedTask(Result):
    model_config = ConfigDict(extra="allow")
    result_type: Literal["task"]
    task_id: str
    status: str
    poll_interval_ms: int | None = None


class TaskState(Result):
    model_config = ConfigDict(extra="allow")
    result_type: Literal["complete"]
    task_id: str
    status: str
    result: dict[str, Any] | None = None


class TaskParams(RequestParams):
    task_id: str


class GetTask(Request[TaskParams, Literal["tasks/get"]]):
    method: Literal["tasks/get"] = "tasks/get"
    name_param = "taskId"


class Tasks(ClientExtension):
    identifier = TASKS_EXTENSION

    def __init__(self) -> None:
        self.seen: list[str] = []

    def claims(self) -> Sequence[ResultClaim[Any]]:
        return (ResultClaim(result_type="task", model=CreatedTask, resolve=self.resolve),)

    async def resolve(self, created: CreatedTask, ctx: ClaimContext) -> CallToolResult:
        self.seen.append(created.status)
        while True:
            request = GetTask(params=TaskParams(task_id=created.task_id))
            state = await ctx.session.send_request(request, TaskState)
            self.seen.append(state.status)
            if state.status == "completed" and state.result is not None:
                return CallToolResult.model_validate(state.result)
            assert state.status == "working", state
            await asyncio.sleep((created.poll_interval_ms or 100) / 1000)


@pytest.fixture(scope="module")
def always_tasks(engine: AsyncLLM) -> Iterator[LiveServer]:
    with LiveServer(engine, task_threshold_s=0.0, task_poll_interval_s=0.05) as live:
        yield live


async def test_the_sdk_resolves_a_task_into_the_direct_result(always_tasks: LiveServer) -> None:
    arguments = {"prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    async with Client(always_tasks.url, mode="auto") as plain:  # undeclared: answered directly
        direct = await plain.call_tool("generate", arguments)
    extension = Tasks()
    async with Client(always_tasks.url, mode="auto", extensions=[extension]) as client:
        result = await client.call_tool("generate", arguments)
    assert extension.seen[0] == "working" and extension.seen[-1] == "completed"
    assert result.content == direct.content
    assert result.structured_content is not None and direct.structured_content is not None
    assert result.structured_content["text"] == direct.structured_content["text"]
