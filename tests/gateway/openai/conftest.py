"""The official ``openai`` client on the suite's shared live server, and the model it serves."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.gateway.live_server import LiveServer


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id  # the name the server answers to
