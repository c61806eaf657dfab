"""A bounded fuzz run against the live endpoint: random headers, envelopes, methods, params and
raw bytes. Every answer must be a schema-valid JSON-RPC message (or an empty 202) whose HTTP
status is the one its error code calls for, and the server must stay up."""

from __future__ import annotations

import string
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kvgate.engine import AsyncLLM
from kvgate.protocol.errors import INVALID_REQUEST, LEGACY_HTTP_STATUS, MODERN_HTTP_STATUS
from kvgate.schemas.mcp_wire import LEGACY_WIRE, MODERN_WIRE, RESULT_TYPES, validate_server_message
from tests.gateway.live_server import LiveServer
from tests.gateway.wire import parse_sse

EXAMPLES = 300
TRANSPORT_STATUSES = {400, 403, 405, 406, 408, 413, 415}  # refused before JSON-RPC: -32600
METHODS = sorted(RESULT_TYPES) + ["ping", "logging/setLevel", "resources/subscribe", "nope/x"]
visible = st.text(alphabet=string.printable.strip() + " ", max_size=30)
header_text = visible.map(str.strip)  # an HTTP client cannot send surrounding whitespace
small_json = st.recursive(
    st.none() | st.booleans() | st.integers(-20, 20) | st.floats(-1e3, 1e3) | visible,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(visible, children, max_size=4)
    ),
    max_leaves=10,
)
arguments = st.fixed_dictionaries(
    {},
    optional={
        "prompt": visible,
        "text": visible,
        "max_tokens": st.integers(-2, 12) | visible,
        "temperature": st.floats(-1, 3) | st.none(),
        "cache_key": visible | st.integers(-5, 5),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["user", "system", "x"]), "content": visible}
            ),
            max_size=2,
        )
        | small_json,
        "stop": st.lists(visible, max_size=3) | small_json,
    },
)


def often(value: Any, other: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly ``value``, sometimes something drawn from ``other`` (hypothesis favours the
    ends of a range, so the odd case sits in its middle)."""
    return st.integers(0, 9).flatmap(lambda i: other if i == 5 else st.just(value))


envelope_meta = st.fixed_dictionaries(
    {
        "io.modelcontextprotocol/protocolVersion": often(
            MODERN_WIRE, st.just(LEGACY_WIRE) | visible
        ),
        "io.modelcontextprotocol/clientCapabilities": often({}, small_json),
    }
)
meta = st.builds(
    lambda required, extra: {**required, **extra},
    envelope_meta | st.just({}),
    st.fixed_dictionaries(
        {},
        optional={
            "progressToken": st.integers(0, 9) | visible | st.booleans(),
            "dev.kvgate/timeoutMs": st.integers(-5, 5000) | visible,
        },
    ),
)
params = st.fixed_dictionaries(
    {"_meta": meta},
    optional={
        "name": often("generate", st.sampled_from(["chat", "tokenize", "nope"]) | visible),
        "arguments": st.one_of(arguments, arguments, small_json),
        "uri": visible,
        "cursor": visible,
        "notifications": small_json,
    },
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[bytes, dict[str, str], str | None]:
    method = draw(often("tools/call", st.sampled_from(METHODS) | visible))
    well_formed = draw(often(True, st.just(False)))
    envelope: dict[str, Any] = {
        "jsonrpc": draw(often("2.0", visible)),
        "method": method,
        "params": draw(params if well_formed else small_json),
    }
    if draw(often(True, st.just(False))):  # else a notification
        plain_id = draw(often(True, st.just(False)))
        envelope["id"] = draw(
            st.integers(-5, 10**6) if plain_id else visible | st.none() | st.floats(0, 1)
        )
    body = draw(often("object", st.sampled_from(["json", "bytes"])))
    content = (
        orjson.dumps(envelope)
        if body == "object"
        else orjson.dumps(draw(small_json))
        if body == "json"
        else draw(st.binary(max_size=200))
    )
    version = draw(often(MODERN_WIRE, st.sampled_from([LEGACY_WIRE, None]) | header_text))
    headers = {
        "Content-Type": draw(often("application/json", st.just("text/plain"))),
        "Accept": draw(
            often(
                "application/json, text/event-stream",
                st.sampled_from(["application/json", "image/png"]),
            )
        ),
    }
    if version is not None:
        headers["MCP-Protocol-Version"] = version
    headers["Mcp-Method"] = draw(often(method.strip(), header_text))
    name = envelope["params"].get("name") if isinstance(envelope["params"], dict) else None
    headers["Mcp-Name"] = draw(often(str(name).strip(), header_text))
    cache_key = arguments_of(envelope).get("cache_key")
    if cache_key is not None or draw(st.booleans()):
        headers["Mcp-Param-Cache-Key"] = draw(often(str(cache_key).strip(), header_text))
    return content, headers, version


@pytest.fixture(scope="module")
def server(engine: AsyncLLM) -> Iterator[LiveServer]:
    """A valid subscriptions/listen is a stream that lasts ``listen_max_s``, its keep-alives
    holding off the client's read timeout: keep each one short here."""
    with LiveServer(engine, max_body_bytes=64 * 1024, keepalive_s=0.2, listen_max_s=0.5) as live:
        yield live


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as client:
        yield client


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(request=requests())
def test_every_answer_is_well_formed_with_the_right_status(
    http: httpx.Client, server: LiveServer, request: tuple[bytes, dict[str, str], str | None]
) -> None:
    content, headers, version = request
    response = http.post(server.url, content=content, headers=headers)
    event(f"status {response.status_code}")
    assert response.status_code != 500, response.text
    if response.status_code == 202:
        assert response.content == b""
        return
    modern = version == MODERN_WIRE
    wire = MODERN_WIRE if modern else LEGACY_WIRE
    kind = response.headers.get("content-type", "")
    messages = (
        parse_sse(response.text) if kind.startswith("text/event-stream") else [response.json()]
    )
    assert messages and "method" not in messages[-1]  # it ends with the response
    sent = _method(content)
    for message in messages:
        validate_server_message(wire, message, sent if sent in RESULT_TYPES else None)
    final = messages[-1]
    event(f"error {final['error']['code']}" if "error" in final else f"result of {sent}")
    if "error" not in final:
        assert response.status_code == 200
        return
    code = final["error"]["code"]
    if response.status_code in TRANSPORT_STATUSES and code == INVALID_REQUEST:
        return
    if kind.startswith("text/event-stream"):  # an error after the stream began
        assert response.status_code == 200
        return
    table = MODERN_HTTP_STATUS if modern else LEGACY_HTTP_STATUS
    assert response.status_code == table.get(code, 200), (code, response.status_code)


def test_the_server_is_still_up_after_the_fuzz(http: httpx.Client, server: LiveServer) -> None:
    assert http.get(server.base + "/healthz").status_code == 200
    assert http.get(server.base + "/readyz").status_code == 200


def arguments_of(envelope: dict[str, Any]) -> dict[str, Any]:
    params = envelope["params"]
    arguments = params.get("arguments") if isinstance(params, dict) else None
    return arguments if isinstance(arguments, dict) else {}


def _method(content: bytes) -> str | None:
    try:
        value = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    return value.get("method") if isinstance(value, dict) else None
