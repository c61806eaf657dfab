"""The request pipeline, one test per bad input with its exact HTTP status and JSON-RPC code,
plus the happy paths of both eras. Every server message is schema-checked by `wire`."""

from __future__ import annotations

from collections.abc import Iterator
from http.client import HTTPConnection

import httpx
import orjson
import pytest

from kvgate.gateway.catalog.catalog import Catalog
from kvgate.schemas.mcp_wire import validate_server_message
from tests.gateway.live_server import LiveServer
from tests.gateway.wire import (
    MODERN,
    call,
    legacy,
    modern_headers,
    modern_meta,
    post,
)


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=30) as client:
        yield client


def body(method: str, request_id: int = 1, **params: object) -> dict:
    return {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": method,
        "params": {**params, "_meta": modern_meta()},
    }


# --------------------------------------------------------------------------- happy paths


def test_discover_lists_every_served_version(http: httpx.Client, server: LiveServer) -> None:
    result = call(http, server.url, "server/discover").result
    assert result["supportedVersions"] == ["2026-07-28", "2025-11-25", "2025-06-18", "2025-03-26"]
    assert set(result["capabilities"]) == {"tools", "resources", "prompts", "extensions"}
    assert result["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "kvgate"
    assert result["ttlMs"] > 0 and result["cacheScope"] == "public"


@pytest.mark.parametrize(
    ("method", "key"),
    [
        ("tools/list", "tools"),
        ("resources/list", "resources"),
        ("resources/templates/list", "resourceTemplates"),
        ("prompts/list", "prompts"),
    ],
)
def test_lists_carry_caching_hints(
    http: httpx.Client, server: LiveServer, method: str, key: str
) -> None:
    first = call(http, server.url, method, request_id="a")
    second = call(http, server.url, method, request_id=2)
    assert first.result == second.result and first.result[key]
    assert (first.body["id"], second.body["id"]) == ("a", 2)
    assert first.result["cacheScope"] == "public" and first.result["ttlMs"] > 0


def test_tools_are_listed_in_a_fixed_order(http: httpx.Client, server: LiveServer) -> None:
    tools = call(http, server.url, "tools/list").result["tools"]
    assert [t["name"] for t in tools] == ["generate", "chat", "tokenize"]


def test_resource_read_and_unknown_uri(http: httpx.Client, server: LiveServer) -> None:
    uri = call(http, server.url, "resources/list").result["resources"][0]["uri"]
    contents = call(http, server.url, "resources/read", {"uri": uri}, name=uri).result["contents"]
    assert orjson.loads(contents[0]["text"])["model"] == server.app.state.served.current.facts.name
    missing = call(
        http, server.url, "resources/read", {"uri": "kvgate://nope"}, name="kvgate://nope"
    )
    assert (missing.status, missing.error["code"]) == (400, -32602)
    assert missing.error["data"] == {"uri": "kvgate://nope"}


def test_prompt_get(http: httpx.Client, server: LiveServer) -> None:
    result = call(
        http,
        server.url,
        "prompts/get",
        {"name": "summarize", "arguments": {"text": "abc"}},
        name="summarize",
    ).result
    assert result["messages"][0]["content"]["text"].endswith("abc")
    missing = call(http, server.url, "prompts/get", {"name": "nope"}, name="nope")
    assert (missing.status, missing.error["code"]) == (400, -32602)


def test_a_new_catalog_is_served_at_once(engine: object) -> None:
    with LiveServer(engine) as live, httpx.Client() as client:
        served = live.app.state.served
        before = call(client, live.url, "server/discover").result
        served.swap(Catalog(served.current.facts, instructions="Now different."))
        after = call(client, live.url, "server/discover").result
    assert before["instructions"] != after["instructions"] == "Now different."


@pytest.mark.parametrize("retry", [{"requestState": "opaque"}, {"inputResponses": {"q": {}}}])
def test_mrtr_retries_bypass_the_discovery_cache(
    http: httpx.Client, server: LiveServer, retry: dict
) -> None:
    """caching.mdx: results of requests carrying inputResponses or requestState MUST NOT be
    cached; they are built from the catalog and never touch the discovery cache."""
    cache = server.app.state.discovery_cache
    plain = call(http, server.url, "tools/list").result
    before = dict(cache.stats)
    retried = call(http, server.url, "tools/list", retry).result
    after = cache.stats
    assert retried == plain
    assert (after["hits"], after["misses"]) == (before["hits"], before["misses"])
    call(http, server.url, "tools/list")
    assert cache.stats["hits"] == before["hits"] + 1  # the counters do move for a plain call


def test_notification_is_accepted_without_body(http: httpx.Client, server: LiveServer) -> None:
    note = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}}
    exchange = post(http, server.url, note, modern_headers("notifications/cancelled"))
    assert (exchange.status, exchange.messages) == (202, [])


def test_whitespace_around_header_values_is_ignored(server: LiveServer) -> None:
    # httpx refuses to send such a header, http.client does not (RFC 9110 5.5: OWS is not data)
    connection = HTTPConnection("127.0.0.1", server.port, timeout=30)
    headers = {**modern_headers("tools/call"), "Mcp-Name": "  tokenize\t"}
    connection.request(
        "POST",
        "/mcp",
        orjson.dumps(body("tools/call", name="tokenize", arguments={"text": "a"})),
        headers,
    )
    response = connection.getresponse()
    message = orjson.loads(response.read())
    connection.close()
    validate_server_message(MODERN, message, "tools/call")
    assert response.status == 200 and message["result"]["isError"] is False


# --------------------------------------------------------------------------- legacy wire


def test_legacy_initialize_is_stateless(http: httpx.Client, server: LiveServer) -> None:
    params = {
        "protocolVersion": "2025-11-25",
        "capabilities": {},
        "clientInfo": {"name": "old", "version": "1"},
    }
    exchange = legacy(
        http,
        server.url,
        "initialize",
        params,
        version=None,
        headers={"Mcp-Session-Id": "client-made-up"},
    )
    assert exchange.status == 200 and "mcp-session-id" not in exchange.headers
    assert exchange.result["protocolVersion"] == "2025-11-25"
    assert exchange.result["serverInfo"]["name"] == "kvgate"
    older = legacy(
        http, server.url, "initialize", {**params, "protocolVersion": "2025-03-26"}, version=None
    )
    assert older.result["protocolVersion"] == "2025-03-26"
    note = legacy(http, server.url, "notifications/initialized", request_id=None)
    assert (note.status, note.messages) == (202, [])


@pytest.mark.parametrize("version", ["2025-11-25", "2025-06-18", "2025-03-26", None])
def test_legacy_ping_lists_and_calls(
    http: httpx.Client, server: LiveServer, version: str | None
) -> None:
    assert legacy(http, server.url, "ping", version=version).result == {}
    tools = legacy(http, server.url, "tools/list", version=version).result["tools"]
    assert len(tools) == 3
    called = legacy(
        http,
        server.url,
        "tools/call",
        {"name": "tokenize", "arguments": {"text": "hello"}},
        version=version,
    )
    assert called.result["structuredContent"]["count"] > 0


def test_legacy_unknown_method_is_200_with_method_not_found(
    http: httpx.Client, server: LiveServer
) -> None:
    exchange = legacy(http, server.url, "server/discover")
    assert (exchange.status, exchange.error["code"]) == (200, -32601)


# --------------------------------------------------------------------------- bad inputs


def test_malformed_json(http: httpx.Client, server: LiveServer) -> None:
    exchange = post(http, server.url, b'{"jsonrpc": "2.0", "id": 1,', modern_headers("tools/list"))
    assert (exchange.status, exchange.error["code"]) == (400, -32700)
    assert "id" not in exchange.body


def test_json_array_body(http: httpx.Client, server: LiveServer) -> None:
    exchange = post(
        http, server.url, orjson.dumps([body("tools/list")]), modern_headers("tools/list")
    )
    assert (exchange.status, exchange.error["code"]) == (400, -32600)


def test_missing_meta(http: httpx.Client, server: LiveServer) -> None:
    request = {"jsonrpc": "2.0", "id": 4, "method": "tools/list", "params": {}}
    exchange = post(http, server.url, request, modern_headers("tools/list"))
    assert (exchange.status, exchange.error["code"], exchange.body["id"]) == (400, -32602, 4)


def test_missing_protocol_version_header(http: httpx.Client, server: LiveServer) -> None:
    headers = modern_headers("tools/list")
    del headers["MCP-Protocol-Version"]
    exchange = post(http, server.url, body("tools/list"), headers)
    assert (exchange.status, exchange.error["code"]) == (400, -32020)


def test_mismatched_protocol_version_header(http: httpx.Client, server: LiveServer) -> None:
    exchange = post(
        http,
        server.url,
        body("tools/list"),
        modern_headers("tools/list", **{"MCP-Protocol-Version": "2025-11-25"}),
    )
    assert (exchange.status, exchange.error["code"]) == (400, -32020)


def test_unsupported_version(http: httpx.Client, server: LiveServer) -> None:
    request = body("tools/list")
    request["params"]["_meta"]["io.modelcontextprotocol/protocolVersion"] = "1900-01-01"
    exchange = post(
        http,
        server.url,
        request,
        modern_headers("tools/list", **{"MCP-Protocol-Version": "1900-01-01"}),
    )
    assert (exchange.status, exchange.error["code"]) == (400, -32022)
    assert exchange.error["data"]["requested"] == "1900-01-01"
    assert MODERN in exchange.error["data"]["supported"]


def test_missing_mcp_method(http: httpx.Client, server: LiveServer) -> None:
    headers = modern_headers("tools/list")
    del headers["Mcp-Method"]
    exchange = post(http, server.url, body("tools/list"), headers)
    assert (exchange.status, exchange.error["code"]) == (400, -32020)


def test_mismatched_mcp_method(http: httpx.Client, server: LiveServer) -> None:
    exchange = post(http, server.url, body("tools/list"), modern_headers("prompts/list"))
    assert (exchange.status, exchange.error["code"]) == (400, -32020)


def test_missing_mcp_name(http: httpx.Client, server: LiveServer) -> None:
    exchange = post(
        http,
        server.url,
        body("tools/call", name="tokenize", arguments={"text": "a"}),
        modern_headers("tools/call"),
    )
    assert (exchange.status, exchange.error["code"]) == (400, -32020)


def test_mismatched_mcp_name(http: httpx.Client, server: LiveServer) -> None:
    exchange = post(
        http,
        server.url,
        body("tools/call", name="tokenize", arguments={"text": "a"}),
        modern_headers("tools/call", "generate"),
    )
    assert (exchange.status, exchange.error["code"]) == (400, -32020)


def test_base64_mcp_name_is_decoded(http: httpx.Client, server: LiveServer) -> None:
    exchange = call(
        http,
        server.url,
        "tools/call",
        {"name": "tokenize", "arguments": {"text": "a"}},
        name="=?base64?dG9rZW5pemU=?=",
    )
    assert exchange.status == 200 and not exchange.result["isError"]


def tokenize_with_key(http: httpx.Client, server: LiveServer, headers: dict[str, str]) -> object:
    # tokenize has no cache_key; generate does, and validation happens before any engine work
    args = {"prompt": "hi", "max_tokens": 1, "temperature": 0, "cache_key": "conversation 42 ✓"}
    return call(
        http,
        server.url,
        "tools/call",
        {"name": "generate", "arguments": args},
        name="generate",
        headers=headers,
    )


def test_missing_cache_key_header(http: httpx.Client, server: LiveServer) -> None:
    exchange = tokenize_with_key(http, server, {})
    assert (exchange.status, exchange.error["code"]) == (400, -32020)


def test_mismatched_cache_key_header(http: httpx.Client, server: LiveServer) -> None:
    exchange = tokenize_with_key(http, server, {"Mcp-Param-Cache-Key": "conversation 41"})
    assert (exchange.status, exchange.error["code"]) == (400, -32020)


def test_base64_cache_key_header_matches(http: httpx.Client, server: LiveServer) -> None:
    encoded = "=?base64?Y29udmVyc2F0aW9uIDQyIOKckw==?="  # "conversation 42 ✓"
    exchange = tokenize_with_key(http, server, {"mcp-param-cache-key": encoded})
    assert exchange.status == 200 and not exchange.result["isError"]


def test_unknown_method(http: httpx.Client, server: LiveServer) -> None:
    exchange = call(http, server.url, "tools/destroy")
    assert (exchange.status, exchange.error["code"]) == (404, -32601)


@pytest.mark.parametrize(
    "method", ["initialize", "ping", "logging/setLevel", "resources/subscribe"]
)
def test_removed_methods_are_unknown_under_modern_rules(
    http: httpx.Client, server: LiveServer, method: str
) -> None:
    exchange = call(http, server.url, method)
    assert (exchange.status, exchange.error["code"]) == (404, -32601)


def test_unknown_tool(http: httpx.Client, server: LiveServer) -> None:
    exchange = call(http, server.url, "tools/call", {"name": "nope", "arguments": {}}, name="nope")
    assert (exchange.status, exchange.error["code"]) == (400, -32602)


def test_invalid_arguments_are_a_tool_error(http: httpx.Client, server: LiveServer) -> None:
    exchange = call(
        http,
        server.url,
        "tools/call",
        {"name": "generate", "arguments": {"prompt": "hi", "max_tokens": -1}},
        name="generate",
    )
    assert exchange.status == 200 and exchange.result["isError"] is True
    assert "max_tokens: -1 is less than the minimum of 1" in exchange.result["content"][0]["text"]


def test_oversized_body(http: httpx.Client, server: LiveServer) -> None:
    request = body("tools/call", name="tokenize", arguments={"text": "x" * 70_000})
    exchange = post(http, server.url, request, modern_headers("tools/call", "tokenize"))
    assert (exchange.status, exchange.error["code"]) == (413, -32600)


def test_wrong_content_type(http: httpx.Client, server: LiveServer) -> None:
    exchange = post(
        http,
        server.url,
        body("tools/list"),
        modern_headers("tools/list", **{"Content-Type": "text/plain"}),
    )
    assert (exchange.status, exchange.error["code"]) == (415, -32600)


def test_unacceptable_accept(http: httpx.Client, server: LiveServer) -> None:
    exchange = post(
        http, server.url, body("tools/list"), modern_headers("tools/list", Accept="text/html")
    )
    assert (exchange.status, exchange.error["code"]) == (406, -32600)


def test_foreign_origin(http: httpx.Client, server: LiveServer) -> None:
    exchange = post(
        http,
        server.url,
        body("tools/list"),
        modern_headers("tools/list", Origin="http://evil.example.com"),
    )
    assert (exchange.status, exchange.error["code"]) == (403, -32600)
    assert "id" not in exchange.body


@pytest.mark.parametrize(
    "origin", ["http://localhost:3000", "http://127.0.0.1", "https://app.example.com"]
)
def test_local_and_configured_origins(http: httpx.Client, server: LiveServer, origin: str) -> None:
    assert call(http, server.url, "tools/list", headers={"Origin": origin}).status == 200


def test_rebinding_host(http: httpx.Client, server: LiveServer) -> None:
    exchange = post(
        http, server.url, body("tools/list"), modern_headers("tools/list", Host="evil.example.com")
    )
    assert exchange.status == 403


@pytest.mark.parametrize("verb", ["GET", "DELETE"])
def test_get_and_delete(http: httpx.Client, server: LiveServer, verb: str) -> None:
    response = http.request(verb, server.url, headers={"Accept": "text/event-stream"})
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"


@pytest.mark.parametrize(
    "params",
    [
        {"name": {"a": 1}, "arguments": {}},
        {"name": ["generate"]},
        {"name": "tokenize", "arguments": ["text"]},
        {"name": "tokenize", "arguments": "text"},
        {"name": "tokenize", "arguments": None},
    ],
)
def test_odd_shapes_get_json_rpc_answers(
    http: httpx.Client, server: LiveServer, params: dict
) -> None:
    name = params["name"] if isinstance(params["name"], str) else "x"
    exchange = post(
        http, server.url, body("tools/call", **params), modern_headers("tools/call", name)
    )
    assert exchange.status in (200, 400)
    assert "error" in exchange.body or exchange.result["isError"] is True


def test_boolean_progress_token_is_not_a_token(http: httpx.Client, server: LiveServer) -> None:
    exchange = call(
        http,
        server.url,
        "tools/call",
        {"name": "tokenize", "arguments": {"text": "a"}},
        name="tokenize",
        meta={"progressToken": True},
    )
    assert exchange.headers["content-type"] == "application/json"


def test_health_and_readiness(http: httpx.Client, server: LiveServer) -> None:
    assert http.get(server.base + "/healthz").json() == {"status": "ok"}
    assert http.get(server.base + "/readyz").json() == {"ready": True, "replicas": [True]}


def test_requests_are_counted_in_metrics(http: httpx.Client, server: LiveServer) -> None:
    call(http, server.url, "tools/list")
    call(http, server.url, "definitely/unknown")
    text = http.get(server.base + "/metrics").text
    assert 'kvgate_requests_total{api="mcp",method="tools/list",outcome="ok",tool=""}' in text
    assert 'method="unknown",outcome="error"' in text
    assert "vllm:num_requests_running" in text
