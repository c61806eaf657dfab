"""``/v1/responses`` and reasoning in fleet mode: the gateway renders a Responses request as
the chat it is and sends it upstream as a chat completion (``Generations`` → ``Fleet``), so a
fleet serves it as the embedded engine does; an upstream with a reasoning parser splits its
own thinking and the gateway relays it (``delta.reasoning`` → ``reasoning`` items)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import jsonschema
import openai
import pytest

from kvgate.engine import AsyncLLM
from kvgate.gateway.settings import Settings
from kvgate.gateway.upstream.fleet import Fleet
from tests.gateway.live_server import LiveServer
from tests.gateway.openai.test_responses import TOOLS, WEATHER


@contextmanager
def fleet_over(engine: AsyncLLM, **upstream_settings: Any) -> Iterator[openai.OpenAI]:
    """A fleet gateway (in process) over one kvgate upstream."""
    with LiveServer(engine, **upstream_settings) as upstream:
        fleet = Fleet.connect(Settings(upstream=(upstream.base,), upstream_health_interval_s=0))
        with (
            LiveServer(None, backend=fleet) as gateway,
            openai.OpenAI(base_url=gateway.base + "/v1", api_key="x", max_retries=0) as client,
        ):
            yield client


@pytest.fixture(scope="module")
def fleet_client(engine: AsyncLLM) -> Iterator[openai.OpenAI]:
    with fleet_over(engine) as client:
        yield client


@pytest.fixture(scope="module")
def thinking_fleet_client(engine: AsyncLLM) -> Iterator[openai.OpenAI]:
    with fleet_over(engine, reasoning_parser="deepseek_r1") as client:
        yield client


def test_a_forced_call_through_the_fleet_validates(fleet_client: openai.OpenAI) -> None:
    model = fleet_client.models.list().data[0].id
    out = fleet_client.responses.create(
        model=model, input="Weather?", tools=TOOLS, parallel_tool_calls=False,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=150,
    )  # fmt: skip
    calls = [i for i in out.output if i.type == "function_call"]
    assert [c.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)


def test_the_upstreams_thinking_is_relayed(thinking_fleet_client: openai.OpenAI) -> None:
    fleet_client = thinking_fleet_client
    model = fleet_client.models.list().data[0].id
    fields = {"model": model, "input": "Think.", "max_output_tokens": 6, "temperature": 0}
    eos = {"ignore_eos": True}
    whole = fleet_client.responses.create(**fields, extra_body=eos)  # type: ignore[arg-type]
    assert [i.type for i in whole.output] == ["reasoning"]
    with fleet_client.responses.create(stream=True, **fields, extra_body=eos) as stream:  # type: ignore[arg-type]
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == whole.output[0].content[0].text  # type: ignore[union-attr]
