"""``store`` and ``previous_response_id`` with ``--redis-url``: a response stored by one
gateway is continued by another (two apps over one private redis-server, two API-key tenants),
whole or streamed; it lives ``--responses-ttl`` seconds; an unknown id is a 404, and so —
in the very same words — is another tenant's id, continued or rendered, and a record that is
not a stored response (junk, another type, 24 MiB: which costs no memory)."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis

from kvgate.engine import AsyncLLM
from kvgate.gateway.openai.response_store import key_of
from tests.gateway.http.test_hostile import rss_mib
from tests.gateway.live_server import LiveServer
from tests.gateway.redis_fixtures import RedisServer, requires_redis_server

pytestmark = [pytest.mark.redis, requires_redis_server]
TTL_S = 120
KEYS = {"alpha": "alpha-key", "beta": "beta-key"}
ALPHA = "key:alpha"  # the tenant an API key proves (identity.Identity)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with RedisServer(Path(tmp_path_factory.mktemp("redis"))) as server:
        yield server


@pytest.fixture(scope="module")
def servers(
    engine: AsyncLLM, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[LiveServer]]:
    keys = tmp_path_factory.mktemp("keys") / "keys"
    lines = [f"{t}: {hashlib.sha256(k.encode()).hexdigest()}\n" for t, k in KEYS.items()]
    keys.write_text("".join(lines))
    options = {"redis_url": redis_server.url, "responses_ttl_s": TTL_S, "api_keys_file": str(keys)}
    with LiveServer(engine, **options) as a, LiveServer(engine, **options) as b:
        yield [a, b]


@pytest.fixture(scope="module")
def gateways(servers: list[LiveServer]) -> Iterator[list[openai.OpenAI]]:
    """Tenant alpha's clients of the two gateways."""
    clients = [
        openai.OpenAI(base_url=s.base + "/v1", api_key=KEYS["alpha"], max_retries=0)
        for s in servers
    ]
    yield clients
    for client in clients:
        client.close()


@pytest.fixture(scope="module")
def raw(redis_server: RedisServer) -> Iterator[redis.Redis]:
    with redis.Redis.from_url(redis_server.url) as client:
        yield client


def post(server: LiveServer, path: str, tenant: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    return httpx.post(server.base + path, json=body, headers=headers, timeout=60)


def going_on(server: LiveServer, path: str, tenant: str, response_id: str) -> httpx.Response:
    """Continue (or render) ``response_id`` as ``tenant``."""
    body = {"input": "Go on.", "previous_response_id": response_id, "max_output_tokens": 2}
    return post(server, path, tenant, body)


def refused(server: LiveServer, path: str, tenant: str, response_id: str) -> tuple[int, Any]:
    """The status and body of ``going_on``, the id blanked."""
    answer = going_on(server, path, tenant, response_id)
    return answer.status_code, orjson.loads(answer.content.replace(response_id.encode(), b"ID"))


def new_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def test_a_response_stored_on_one_gateway_is_continued_on_another(
    gateways: list[openai.OpenAI], raw: redis.Redis
) -> None:
    one, two = gateways
    first = one.responses.create(input="Name a colour.", store=True, max_output_tokens=6)
    assert first.store is True
    assert 0 < raw.ttl(key_of(ALPHA, first.id)) <= TTL_S
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


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/responses/render"])
def test_another_tenants_response_reads_as_an_unknown_one(
    servers: list[LiveServer], gateways: list[openai.OpenAI], path: str
) -> None:
    """Beta continued alpha's stored conversation (200, alpha's reply continued) and rendered
    it (200, alpha's prompt as token ids); an unknown id was a 404. Now both are the 404."""
    secret = gateways[0].responses.create(
        input="The launch code is SECRET-7.", store=True, max_output_tokens=2
    )
    for server in servers:
        assert going_on(server, path, "alpha", secret.id).status_code == 200
        unknown = refused(server, path, "beta", new_id())
        assert unknown[0] == 404 and unknown[1]["error"]["code"] == "not_found"
        assert refused(server, path, "beta", secret.id) == unknown


def test_a_record_that_is_not_a_stored_response_reads_as_an_unknown_one(
    servers: list[LiveServer], raw: redis.Redis
) -> None:
    """Junk under a response's key was a 500 ("Internal error"), another type a 500 naming
    WRONGTYPE, and a 24 MiB record was pulled whole and parsed (the process grew ~380 MiB).
    Each now reads as an unknown id, and the 24 MiB one costs no memory."""
    server = servers[0]
    unknown = refused(server, "/v1/responses", "alpha", new_id())
    message = {"role": "user", "content": "hi"}
    many = [message] * ((24 << 20) // len(orjson.dumps(message)))
    bad_call = {"role": "assistant", "content": None, "tool_calls": [{"function": 5}]}
    junk: list[Any] = [
        b"not json",
        b"[1,2,3]",
        b'{"response":{}}',
        b'{"messages":"hi"}',
        b"[null]",
        b"12",
        orjson.dumps({"tenant": ALPHA, "response": {}, "messages": [None]}),
        orjson.dumps({"tenant": ALPHA, "response": {}, "messages": [message, bad_call]}),
        orjson.dumps({"tenant": "key:beta", "response": {}, "messages": [message]}),
        {"messages": "a hash"},
        orjson.dumps({"tenant": ALPHA, "response": {}, "messages": many}),  # 24 MiB
    ]
    for value in junk:
        response_id = new_id()
        key = key_of(ALPHA, response_id)
        if isinstance(value, dict):
            raw.hset(key, mapping=value)
        else:
            raw.set(key, value, ex=60)
        before = rss_mib()
        reads = 3 if len(value) > 1 << 20 else 1
        answers = [refused(server, "/v1/responses", "alpha", response_id) for _ in range(reads)]
        grown = rss_mib() - before
        if reads > 1:
            print(f"a {len(value) >> 20} MiB record read {reads} times: RSS {grown:+.1f} MiB")
            assert grown <= 16
        assert answers == [unknown] * reads, repr(value)[:60]
