"""``store`` and ``previous_response_id`` with ``--redis-url``: a response stored by one
gateway is continued by another (two apps over one private redis-server), whole or streamed;
it lives ``--responses-ttl`` seconds; an unknown id is a 404."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import redis

from engine import AsyncLLM
from tests.gateway.live_server import LiveServer
from tests.gateway.redis_fixtures import RedisServer, requires_redis_server

pytestmark = [pytest.mark.redis, requires_redis_server]
TTL_S = 120


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(Path(tmp_path_factory.mktemp("redis"))) as server:
        yield server


@pytest.fixture(scope="module")
def gateways(engine: AsyncLLM, redis_server: RedisServer) -> Iterator[list[openai.OpenAI]]:
    options = {"redis_url": redis_server.url, "responses_ttl_s": TTL_S}
    with LiveServer(engine, **options) as a, LiveServer(engine, **options) as b:
        clients = [
            openai.OpenAI(base_url=s.base + "/v1", api_key="x", max_retries=0) for s in (a, b)
        ]
        yield clients
        for client in clients:
            client.close()


def test_a_response_stored_on_one_gateway_is_continued_on_another(
    gateways: list[openai.OpenAI], redis_server: RedisServer
) -> None:
    one, two = gateways
    first = one.responses.create(input="Name a colour.", store=True, max_output_tokens=6)
    assert first.store is True
    with redis.Redis.from_url(redis_server.url) as raw:
        assert 0 < raw.ttl(f"kvgate:response:{first.id}") <= TTL_S
    second = two.responses.create(
        input="And another?", previous_response_id=first.id, store=True, max_output_tokens=6
    )
    assert second.previous_response_id == first.id
    assert first.usage is not None and second.usage is not None
    # the second prompt holds the first turn (its input and its reply) before the new input
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens

    with one.responses.create(
        input="Once more.", previous_response_id=second.id, store=True, max_output_tokens=4,
        stream=True,
    ) as stream:  # fmt: skip
        third = [e for e in stream][-1].response
    fourth = two.responses.create(input="Last.", previous_response_id=third.id, max_output_tokens=2)
    assert fourth.store is False  # not asked to be stored
    assert fourth.usage is not None and third.usage is not None
    assert fourth.usage.input_tokens > third.usage.input_tokens + third.usage.output_tokens


def test_an_unknown_previous_response_is_a_404(gateways: list[openai.OpenAI]) -> None:
    with pytest.raises(openai.NotFoundError, match="resp_nope"):
        gateways[0].responses.create(input="hi", previous_response_id="resp_nope")
