"""JSON-RPC 2.0 framing with orjson: parse one inbound message, encode responses.

Results that were serialized ahead of time (the catalog) are spliced into the envelope as
bytes, so a cached ``tools/list`` costs one concatenation instead of a re-encode.
"""

from __future__ import annotations

from typing import Any

import orjson

from kvgate.protocol.errors import INVALID_REQUEST, PARSE_ERROR, ProtocolError
from kvgate.protocol.jsonrpc_types import Message, RequestId

_VERSION_PREFIX = b'{"jsonrpc":"2.0","id":'
MAX_DEPTH = 64  # nesting of objects and arrays; orjson's own fixed limit is 1024


def parse_message(body: bytes, max_depth: int = MAX_DEPTH) -> Message:
    """Decode a POST body into a request or notification, or raise the matching error.

    Batches (JSON arrays) are not part of MCP and are rejected as invalid requests, as are
    responses: this server never sends a request a client could answer. JSON nested deeper
    than ``max_depth`` is refused as an invalid request (nothing legitimate nests that deep).
    """
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc) or "recursion" in str(exc):
            raise _too_deep(max_depth) from None
        raise ProtocolError(PARSE_ERROR, f"Parse error: {exc}") from None
    # A document with no more brackets than the limit cannot nest deeper: skip the walk.
    if body.count(b"[") + body.count(b"{") > max_depth and nesting_depth(value) > max_depth:
        raise _too_deep(max_depth, _read_id(value) if isinstance(value, dict) else None)
    if isinstance(value, list):
        raise ProtocolError(INVALID_REQUEST, "Invalid request: batches are not supported")
    if not isinstance(value, dict):
        raise ProtocolError(INVALID_REQUEST, "Invalid request: the body must be a JSON object")
    request_id = _read_id(value)
    if value.get("jsonrpc") != "2.0":
        raise ProtocolError(
            INVALID_REQUEST, 'Invalid request: "jsonrpc" must be "2.0"', request_id=request_id
        )
    method = value.get("method")
    if not isinstance(method, str) or not method:
        raise ProtocolError(
            INVALID_REQUEST,
            'Invalid request: "method" must be a non-empty string',
            request_id=request_id,
        )
    if "id" in value and request_id is None:
        raise ProtocolError(
            INVALID_REQUEST, 'Invalid request: "id" must be a string or an integer, not null'
        )
    params = value.get("params", {})
    if not isinstance(params, dict):
        raise ProtocolError(
            INVALID_REQUEST, 'Invalid request: "params" must be an object', request_id=request_id
        )
    return Message(method=method, params=params, id=request_id)


def _too_deep(max_depth: int, request_id: RequestId | None = None) -> ProtocolError:
    return ProtocolError(
        INVALID_REQUEST,
        f"Invalid request: JSON nested deeper than {max_depth}",
        request_id=request_id,
    )


def nesting_depth(value: Any) -> int:
    """Nesting depth of containers (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            node = node.values()
        elif not isinstance(node, list):
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in node if isinstance(child, dict | list))
    return deepest


def _read_id(value: dict[str, Any]) -> RequestId | None:
    request_id = value.get("id")
    if isinstance(request_id, str) or (
        isinstance(request_id, int) and not isinstance(request_id, bool)
    ):
        return request_id
    return None


def encode_result(request_id: RequestId, result: dict[str, Any]) -> bytes:
    return orjson.dumps({"jsonrpc": "2.0", "id": request_id, "result": result})


def splice_result(request_id: RequestId, result_bytes: bytes) -> bytes:
    """The response envelope around an already serialized ``result`` object."""
    return b"".join((_VERSION_PREFIX, orjson.dumps(request_id), b',"result":', result_bytes, b"}"))


def encode_error(error: ProtocolError) -> bytes:
    response: dict[str, Any] = {"jsonrpc": "2.0"}
    if error.request_id is not None:
        response["id"] = error.request_id
    response["error"] = error.to_error()
    return orjson.dumps(response)


def encode_notification(method: str, params: dict[str, Any]) -> bytes:
    return orjson.dumps({"jsonrpc": "2.0", "method": method, "params": params})
