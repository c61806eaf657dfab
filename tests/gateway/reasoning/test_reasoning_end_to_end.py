"""Reasoning through the official ``openai`` client, with the tiny model's thinking forced
into its output: without a parser a ``structured_outputs`` regex makes it write
``<think>…</think>`` and that is its content; with ``--reasoning-parser qwen3`` the same
request's thinking comes out as ``message.reasoning`` and ``delta.reasoning`` (the regex now
applies after the thinking, whose opening tag the grammar writes); with ``deepseek_r1`` (the
template opens the thinking) an unconstrained reply cut short is all thinking. Streamed
pieces add up to the whole answer, and ``/v1/responses`` gives the same thinking as a
``reasoning`` item with its ``reasoning_text`` events."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from kvgate.engine import AsyncLLM
from tests.gateway.live_server import LiveServer
from tests.gateway.mcp.test_tool_runner import output_schema, run_tool

THINKING = r"<think>[a-z ]{3,12}</think>[a-z]{2,8}"
FORCED = {"structured_outputs": {"regex": THINKING}}
MESSAGES: list[Any] = [{"role": "user", "content": "Think, then answer."}]


def client_of(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def servers(engine: AsyncLLM) -> Iterator[dict[str, LiveServer]]:
    with (
        LiveServer(engine, reasoning_parser="qwen3") as qwen3,
        LiveServer(engine, reasoning_parser="deepseek_r1") as deepseek,
    ):
        yield {"qwen3": qwen3, "deepseek_r1": deepseek}


@pytest.fixture(scope="module")
def parsed(servers: dict[str, LiveServer]) -> Iterator[dict[str, openai.OpenAI]]:
    with client_of(servers["qwen3"]) as q, client_of(servers["deepseek_r1"]) as d:
        yield {"qwen3": q, "deepseek_r1": d}


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def whole_and_streamed(client: openai.OpenAI, **fields: Any) -> tuple[Any, str, str]:
    """The whole answer's message, and the stream's joined ``delta.reasoning`` / content."""
    fields = {"model": model_of(client), "messages": MESSAGES, "temperature": 0, **fields}
    message = client.chat.completions.create(**fields).choices[0].message
    thought, said = [], []
    for chunk in client.chat.completions.create(stream=True, **fields):
        for choice in chunk.choices:
            thought.append((choice.delta.model_extra or {}).get("reasoning") or "")
            said.append(choice.delta.content or "")
    return message, "".join(thought), "".join(said)


def test_without_a_parser_the_forced_thinking_is_content(server: LiveServer) -> None:
    with client_of(server) as client:
        message, thought, said = whole_and_streamed(client, max_tokens=40, extra_body=FORCED)
    assert re.fullmatch(THINKING, message.content)
    assert "reasoning" not in (message.model_extra or {})
    assert said == message.content and thought == ""


def test_qwen3_parser_returns_the_thinking_as_reasoning(
    parsed: dict[str, openai.OpenAI],
) -> None:
    message, thought, said = whole_and_streamed(parsed["qwen3"], max_tokens=24, extra_body=FORCED)
    reasoning = (message.model_extra or {}).get("reasoning")
    assert isinstance(reasoning, str) and reasoning  # the grammar opened it: <think> first
    assert "<think>" not in reasoning and "<think>" not in (message.content or "")
    assert thought == reasoning and said == (message.content or "")


def test_deepseek_r1_parser_reads_a_reply_before_any_end_tag_as_thinking(
    parsed: dict[str, openai.OpenAI],
) -> None:
    eos = {"ignore_eos": True}
    message, thought, said = whole_and_streamed(parsed["deepseek_r1"], max_tokens=8, extra_body=eos)
    reasoning = (message.model_extra or {}).get("reasoning")
    assert reasoning and thought == reasoning
    assert message.content is None and said == ""  # only thinking: no content, as vLLM


def test_responses_give_the_thinking_as_a_reasoning_item(
    parsed: dict[str, openai.OpenAI],
) -> None:
    client = parsed["deepseek_r1"]
    fields = {
        "model": model_of(client),
        "input": "Think.",
        "max_output_tokens": 8,
        "temperature": 0,
    }
    eos = {"ignore_eos": True}
    whole = client.responses.create(**fields, extra_body=eos)  # type: ignore[arg-type]
    (item,) = whole.output
    assert item.type == "reasoning" and item.content
    text = item.content[0].text
    assert text and whole.usage is not None and whole.usage.output_tokens_details.reasoning_tokens
    events: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
    with client.responses.create(stream=True, **fields, extra_body=eos) as stream:  # type: ignore[arg-type]
        kinds = [events.validate_python(e.model_dump()) for e in stream]
    deltas = "".join(e.delta for e in kinds if e.type == "response.reasoning_text.delta")
    assert deltas == text
    assert kinds[-1].response.output[0].type == "reasoning"


def test_mcp_chat_returns_the_thinking_in_structured_content(
    servers: dict[str, LiveServer],
) -> None:
    live = servers["deepseek_r1"]
    arguments = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    with httpx.Client(timeout=60) as http:
        result = run_tool(http, live, "chat", arguments)
    structured = result["structuredContent"]
    assert structured["reasoning"] and structured["text"] == ""
    output_schema(live, "chat").validate(structured)


@pytest.mark.parametrize("kind", ["json", "structural_tag"])
def test_json_text_that_is_not_json_is_a_400_behind_a_parser(
    servers: dict[str, LiveServer], kind: str
) -> None:
    body = {"messages": MESSAGES, "max_tokens": 4, "structured_outputs": {kind: "{not json"}}
    answer = httpx.post(servers["qwen3"].base + "/v1/chat/completions", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "structured_outputs" and "not valid JSON" in error["message"]
