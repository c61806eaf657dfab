"""A raw MCP-over-HTTP client for tests that checks every server message against the spec.

Each response (JSON body or every SSE event) is validated against ``schema.json`` of the wire
revision it was sent on, so no protocol test can pass on a malformed message.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from kvgate.schemas.mcp_wire import LEGACY_WIRE, MODERN_WIRE, validate_server_message

MODERN = MODERN_WIRE
CLIENT_INFO = {"name": "kvgate-tests", "version": "1.0"}


def modern_meta(**extra: Any) -> dict[str, Any]:
    return {
        "io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientInfo": CLIENT_INFO,
        "io.modelcontextprotocol/clientCapabilities": {},
        **extra,
    }


def modern_headers(method: str, name: str | None = None, **extra: str) -> dict[str, str]:
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": MODERN,
        "Mcp-Method": method,
    }
    if name is not None:
        headers["Mcp-Name"] = name
    headers.update(extra)
    return headers


@dataclass
class Exchange:
    status: int
    headers: httpx.Headers
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def body(self) -> dict[str, Any]:
        """The final JSON-RPC response."""
        return self.messages[-1]

    @property
    def error(self) -> dict[str, Any]:
        return self.body["error"]

    @property
    def result(self) -> dict[str, Any]:
        return self.body["result"]


def post(
    client: httpx.Client,
    url: str,
    body: bytes | dict[str, Any],
    headers: dict[str, str],
    wire: str | None = MODERN,
    method: str | None = None,
) -> Exchange:
    """POST and validate; ``wire`` None skips validation (only for non-MCP answers)."""
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    response = client.post(url, content=content, headers=headers)
    exchange = Exchange(response.status_code, response.headers)
    content_type = response.headers.get("content-type", "")
    if content_type.startswith("text/event-stream"):
        exchange.messages = parse_sse(response.text)
    elif content_type.startswith("application/json") and response.content:
        exchange.messages = [response.json()]
    if wire is not None:
        for message in exchange.messages:
            validate_server_message(wire, message, method)
    return exchange


def parse_sse(text: str) -> list[dict[str, Any]]:
    events = []
    for block in text.split("\n\n"):
        data = [line[5:].lstrip() for line in block.splitlines() if line.startswith("data:")]
        if data:
            events.append(orjson.loads("\n".join(data)))
    return events


def call(
    client: httpx.Client,
    url: str,
    method: str,
    params: dict[str, Any] | None = None,
    *,
    name: str | None = None,
    headers: dict[str, str] | None = None,
    meta: dict[str, Any] | None = None,
    request_id: int | str = 1,
) -> Exchange:
    """A well-formed modern request; ``headers`` override or add to the standard ones."""
    full = {**(params or {}), "_meta": {**modern_meta(), **(meta or {})}}
    body = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": full}
    return post(
        client, url, body, {**modern_headers(method, name), **(headers or {})}, MODERN, method
    )


def legacy(
    client: httpx.Client,
    url: str,
    method: str,
    params: dict[str, Any] | None = None,
    version: str | None = LEGACY_WIRE,
    request_id: int | str | None = 1,
    headers: dict[str, str] | None = None,
) -> Exchange:
    """A handshake-era request (no ``_meta`` envelope); ``version`` None omits the header."""
    body: dict[str, Any] = {"jsonrpc": "2.0", "method": method, "params": params or {}}
    if request_id is not None:
        body["id"] = request_id
    base = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    if version is not None:
        base["MCP-Protocol-Version"] = version
    return post(client, url, body, {**base, **(headers or {})}, LEGACY_WIRE, method)
