"""The OpenAI Agents SDK against kvgate, built the way its docs show: its default model
(``OpenAIResponsesModel``, so ``/v1/responses``) running an agent with a function tool — the
forced call validated by the SDK and run, its output sent back as a ``function_call_output``
item, the next turn answered —, and the regression of issue 26: a forced call cut by
``max_tokens`` (arguments that are not JSON) stays in the agent's history, and the next turn
is served (it was a 400)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

import httpx
import pytest

from tests.gateway.live_server import LiveServer

agents = pytest.importorskip("agents")
from agents import (  # noqa: E402
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from openai import AsyncOpenAI  # noqa: E402
from pydantic import BaseModel  # noqa: E402

set_tracing_disabled(True)


@pytest.fixture
async def client(server: LiveServer) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def served_model(server: LiveServer) -> str:
    model: str = httpx.get(server.base + "/v1/models").json()["data"][0]["id"]
    return model


class Weather(BaseModel):
    """The agent's output type: a short JSON object the tiny model is held to."""

    sky: Literal["sunny", "rainy"]


def weather_tool(calls: list[str]) -> Any:
    @function_tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"18 C and sunny in {city}"

    return get_weather


async def test_an_agent_on_the_default_responses_model_calls_its_tool(
    server: LiveServer, client: AsyncOpenAI
) -> None:
    set_default_openai_client(client, use_for_tracing=False)  # the docs' way: the default model
    calls: list[str] = []
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        model=served_model(server),
        tools=[weather_tool(calls)],
        output_type=Weather,  # text.format json_schema: the answer is held to it
        # required: the random tiny model calls the tool; reset_tool_choice (the default)
        # makes the next turn auto, so the agent answers after the tool's output
        model_settings=ModelSettings(tool_choice="required", max_tokens=60, temperature=0),
    )
    assert isinstance(agent.model, str)
    result = await Runner.run(agent, "Weather in Paris?", max_turns=3)
    assert len(calls) == 1 and calls[0] in ("Paris", "Rome")  # the SDK parsed and ran it
    assert len(result.raw_responses) == 2  # the call, then the answer after its output
    items = [i.type for i in result.new_items]
    assert items[:2] == ["tool_call_item", "tool_call_output_item"]
    assert isinstance(result.final_output, Weather)


async def test_a_forced_call_cut_by_max_tokens_does_not_break_the_next_turn(
    server: LiveServer, client: AsyncOpenAI
) -> None:
    """Through the chat completions model, as it was found (the SDK's Responses model treats
    an ``incomplete`` response as a failure of its own, so a cut call never reaches its
    history there; ``test_responses`` sends such a history to ``/v1/responses`` directly)."""
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return "18 C"

    agent = Agent(
        name="weather",
        model=OpenAIChatCompletionsModel(model=served_model(server), openai_client=client),
        tools=[get_weather],
        # 45 tokens end the tiny model's forced call inside its arguments ('{"city"\n:')
        model_settings=ModelSettings(tool_choice="required", max_tokens=45, temperature=0),
    )
    result = await Runner.run(agent, "Weather in Paris?", max_turns=3)
    (call,) = result.raw_responses[0].output
    assert call.type == "function_call"
    with pytest.raises(ValueError):
        json.loads(call.arguments)  # cut short: the SDK answers it with an error output
    assert calls == []
    assert len(result.raw_responses) == 2  # and the next turn, with it in history, is served
    assert isinstance(result.final_output, str)
