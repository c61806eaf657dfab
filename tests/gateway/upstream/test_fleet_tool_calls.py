"""Tool calling in fleet mode, with real upstream processes: a kvgate engine upstream (the
tiny model; its grammar makes forced calls well-formed) reads the calls and the gateway
relays them, to OpenAI clients as they came and to MCP ``chat`` as parsed
``structuredContent.tool_calls``; an upstream that writes malformed calls
(``bad_upstream``) is a clean 502 / error event / tool error, never a 500."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import orjson
import pytest
from mcp import Client

from tests.gateway.openai.test_tool_calls import MESSAGES, SCHEMAS, TOOLS, WEATHER, accumulate
from tests.gateway.upstream import bad_upstream
from tests.gateway.upstream.processes import Process, call_tool, gateway, running

NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fleet-tools")


@pytest.fixture(scope="module")
def fleet(log_dir: Path) -> Iterator[tuple[Process, Process]]:
    """(a gateway, its one kvgate upstream), both processes."""
    upstream = Process(log_dir)
    with running([upstream]):
        with running([gateway(log_dir, [upstream])], 60) as (g,):
            yield g, upstream


def client(process: Process) -> openai.OpenAI:
    return openai.OpenAI(base_url=process.base + "/v1", api_key="x", max_retries=0)


def create(process: Process, **fields: Any) -> Any:
    with client(process) as c:
        return c.chat.completions.create(
            model=c.models.list().data[0].id,
            messages=fields.pop("messages", MESSAGES),
            tools=fields.pop("tools", TOOLS),
            max_tokens=fields.pop("max_tokens", 120),
            **fields,
        )


def calls_of(message: Any) -> list[dict[str, str]]:
    return [
        {"name": c.function.name, "arguments": c.function.arguments}
        for c in message.tool_calls or []
    ]


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_forced_calls_through_the_fleet_validate(
    fleet: tuple[Process, Process], tool_choice: Any
) -> None:
    g, _ = fleet
    out = create(
        g, tool_choice=tool_choice, parallel_tool_calls=False, temperature=1.0, n=4, seed=3
    )
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        assert tool_choice == "required" or call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.message.tool_calls[0].id for c in out.choices}) == 4


@pytest.mark.parametrize("parallel", [False, True])
def test_streamed_calls_add_up_to_the_answer_and_to_the_upstreams(
    fleet: tuple[Process, Process], parallel: bool
) -> None:
    g, upstream = fleet
    fields = {
        "tool_choice": "required",
        "parallel_tool_calls": parallel,
        "temperature": 0,
        "max_tokens": 100,
    }
    whole = create(g, **fields).choices[0]
    expected = calls_of(whole.message)
    assert expected and expected == calls_of(create(upstream, **fields).choices[0].message)
    with client(g) as c:
        stream = c.chat.completions.create(
            model=c.models.list().data[0].id,
            messages=MESSAGES,
            tools=TOOLS,
            stream=True,
            **fields,
        )
        content, calls, finish = accumulate(stream)
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == expected
    assert finish == whole.finish_reason and not content.strip()


async def test_mcp_chat_with_tools_through_the_fleet(fleet: tuple[Process, Process]) -> None:
    g, upstream = fleet
    arguments = {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": NAMED,
        "temperature": 0,
        "max_tokens": 80,
    }
    async with Client(g.base + "/mcp") as mcp:  # the SDK checks the tool's outputSchema
        result = await mcp.call_tool("chat", arguments)
    assert not result.is_error, result.content
    structured = result.structured_content
    assert structured is not None and structured["finish_reason"] == "tool_calls"
    assert structured["upstream"] == upstream.base
    (call,) = structured["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    jsonschema.validate(call["function"]["arguments"], WEATHER)  # parsed into an object
    direct = call_tool(upstream.base, "chat", arguments)["structuredContent"]["tool_calls"]
    assert [c["function"] for c in direct] == [call["function"]]
    plain = call_tool(g.base, "chat", {**arguments, "tool_choice": "none", "max_tokens": 4})
    assert "tool_calls" not in plain["structuredContent"]


@pytest.fixture(scope="module")
def bad(log_dir: Path) -> Iterator[Process]:
    """A gateway over ``bad_upstream`` (a failure per malformed reply never takes it out)."""
    upstream = Process(log_dir, command=("-m", "tests.gateway.upstream.bad_upstream"))
    with running([upstream], 30):
        flags = ("--upstream-unhealthy-after", "1000")
        with running([gateway(log_dir, [upstream], *flags)], 60) as (g,):
            yield g


def post_chat(g: Process, scenario: str, stream: bool = False) -> httpx.Response:
    body = {
        "model": bad_upstream.MODEL,
        "messages": [{"role": "user", "content": scenario}],
        "tools": TOOLS,
        "stream": stream,
    }
    return httpx.post(g.base + "/v1/chat/completions", json=body, timeout=30)


def chat_arguments(scenario: str) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": scenario}], "tools": TOOLS}


def events(response: httpx.Response) -> list[Any]:
    lines = [line[5:].strip() for line in response.text.splitlines() if line.startswith("data:")]
    return [line if line == "[DONE]" else orjson.loads(line) for line in lines]


def test_an_upstreams_calls_are_relayed_as_it_wrote_them(bad: Process) -> None:
    response = post_chat(bad, "good")
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert choice["message"]["tool_calls"] == [
        {
            "id": "call_up_0",
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": '{"city": "Paris", "unit": "celsius"}',
            },
        },
        {"id": "call_up_1", "type": "function", "function": {"name": "now", "arguments": "{}"}},
    ]
    streamed = events(post_chat(bad, "good", stream=True))
    assert streamed[-1] == "[DONE]"
    chunks = [e for e in streamed[:-1] if e["choices"]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] != "chatcmpl-up" for c in chunks)
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    assert deltas == [entry for calls in bad_upstream.GOOD for entry in calls]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    result = call_tool(bad.base, "chat", chat_arguments("good"))
    assert not result["isError"], result
    assert [c["function"]["arguments"] for c in result["structuredContent"]["tool_calls"]] == [
        {"city": "Paris", "unit": "celsius"},
        {},
    ]


@pytest.mark.parametrize("scenario", sorted(set(bad_upstream.SCENARIOS) - {"good"}))
def test_malformed_tool_calls_are_a_502_an_error_event_or_a_tool_error(
    bad: Process, scenario: str
) -> None:
    response = post_chat(bad, scenario)
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "bad_gateway" and "malformed" in error["message"], error
    streamed = events(post_chat(bad, scenario, stream=True))
    assert streamed[-1] == "[DONE]" and streamed[-2]["error"]["code"] == "bad_gateway"
    relayed = [c for c in streamed[:-2] if c.get("choices")]
    deltas = [d for c in relayed for d in c["choices"][0]["delta"].get("tool_calls", [])]
    if scenario == "late":  # what came before it was relayed, as it came
        assert deltas == [*bad_upstream.GOOD[0], *bad_upstream.GOOD[1]]
    else:
        assert deltas == []
    result = call_tool(bad.base, "chat", chat_arguments(scenario))
    assert result["isError"] and "malformed" in result["content"][0]["text"], result
