"""Request-metadata headers of the Streamable HTTP binding: decoding and header-body checks.

``Mcp-Name`` and ``Mcp-Param-*`` values may carry the Base64 sentinel ``=?base64?…?=`` (for
values that are not plain visible ASCII); they are decoded before any comparison. Tool
parameters whose schema carries ``x-mcp-header`` must be mirrored into ``Mcp-Param-{name}``
so a load balancer can route on them without reading the body; the server checks the mirror.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgate.protocol.errors import header_mismatch

SENTINEL_PREFIX = "=?base64?"
SENTINEL_SUFFIX = "?="
PARAM_HEADER_PREFIX = "mcp-param-"
_SAFE_VALUE = re.compile(r"[\x20-\x7e\t]*")
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_CANONICAL_INTEGER = re.compile(r"-?[0-9]+(\.0+)?")


ROUTING_HEADERS = frozenset(("mcp-protocol-version", "mcp-method", "mcp-name"))


def is_routing_header(name: str) -> bool:
    """A header the server checks against the body (``name`` lower-case): sent twice, a proxy
    would route on the first while a server reading the last checks something else, so a
    repeated one is a header mismatch."""
    return name in ROUTING_HEADERS or name.startswith(PARAM_HEADER_PREFIX)


def decode_header_value(raw: str) -> str:
    """The value a header carries: sentinel-wrapped Base64 decoded, else the raw text.

    Raises HeaderMismatch for characters a header may not hold or a sentinel that does not
    decode to UTF-8.
    """
    if raw.startswith(SENTINEL_PREFIX) and raw.endswith(SENTINEL_SUFFIX) and len(raw) >= 11:
        encoded = raw[len(SENTINEL_PREFIX) : -len(SENTINEL_SUFFIX)]
        try:
            return base64.b64decode(encoded, validate=True).decode("utf-8")
        except ValueError:  # binascii.Error, UnicodeDecodeError, non-ASCII input
            raise header_mismatch("a Base64-encoded header value does not decode") from None
    if _SAFE_VALUE.fullmatch(raw) is None:
        raise header_mismatch("a header value contains characters outside visible ASCII")
    return raw


def encode_header_value(value: str) -> str:
    """The header form of ``value`` (what a conforming client sends); used by tests and tools."""
    plain = (
        _SAFE_VALUE.fullmatch(value) is not None
        and value == value.strip(" \t")
        and not (value.startswith(SENTINEL_PREFIX) and value.endswith(SENTINEL_SUFFIX))
    )
    if plain:
        return value
    return (
        SENTINEL_PREFIX + base64.b64encode(value.encode("utf-8")).decode("ascii") + SENTINEL_SUFFIX
    )


@dataclass(frozen=True, slots=True)
class HeaderParam:
    """One ``x-mcp-header`` annotation: where the value lives in the arguments, and its header."""

    path: tuple[str, ...]
    header: str  # the {name} in Mcp-Param-{name}
    type: str | None


def header_params(input_schema: Mapping[str, Any]) -> tuple[HeaderParam, ...]:
    """Every ``x-mcp-header`` annotation reachable through ``properties`` chains only.

    Raises ValueError for an annotation the spec forbids (bad token, duplicate, non-primitive
    type), so a bad tool definition fails at startup instead of confusing clients.
    """
    found: list[HeaderParam] = []
    _collect(input_schema, (), found)
    seen: set[str] = set()
    for param in found:
        if _TOKEN.fullmatch(param.header) is None:
            raise ValueError(f"x-mcp-header {param.header!r} is not an HTTP token")
        if param.header.lower() in seen:
            raise ValueError(f"x-mcp-header {param.header!r} is not unique")
        if param.type not in ("string", "integer", "boolean"):
            raise ValueError(
                f"x-mcp-header {param.header!r} must annotate a string, integer or boolean"
            )
        seen.add(param.header.lower())
    return tuple(found)


def _collect(schema: Mapping[str, Any], path: tuple[str, ...], found: list[HeaderParam]) -> None:
    for name, sub in (schema.get("properties") or {}).items():
        if not isinstance(sub, Mapping):
            continue
        if "x-mcp-header" in sub:
            found.append(HeaderParam(path + (name,), str(sub["x-mcp-header"]), sub.get("type")))
        _collect(sub, path + (name,), found)


def check_param_headers(
    params: tuple[HeaderParam, ...], arguments: Mapping[str, Any], headers: Mapping[str, str]
) -> None:
    """Raise HeaderMismatch unless every annotated argument present in the body is mirrored
    exactly (after decoding) in its ``Mcp-Param-*`` header, and no such header is sent for an
    argument the body leaves out."""
    for param in params:
        value = _value_at(arguments, param.path)
        raw = headers.get(PARAM_HEADER_PREFIX + param.header.lower())
        header_name = f"Mcp-Param-{param.header}"
        if value is None:
            if raw is not None:  # the load balancer would route on a value the body lacks
                raise header_mismatch(
                    f"{header_name} header is sent but '{'.'.join(param.path)}' is not set"
                )
            continue
        if raw is None:
            raise header_mismatch(
                f"{header_name} header is required when '{'.'.join(param.path)}' is set"
            )
        if not _matches(param.type, value, decode_header_value(raw)):
            raise header_mismatch(f"{header_name} header does not match the body value")


def _value_at(arguments: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    node: Any = arguments
    for key in path:
        if not isinstance(node, Mapping):
            return None
        node = node.get(key)
    return node


def _matches(schema_type: str | None, value: Any, decoded: str) -> bool:
    if isinstance(value, bool):
        return decoded == ("true" if value else "false")
    if schema_type == "integer" and isinstance(value, int | float):
        if _CANONICAL_INTEGER.fullmatch(decoded) is None:
            return False
        return float(value).is_integer() and int(decoded.split(".")[0]) == int(value)
    return isinstance(value, str) and decoded == value


def require_header(headers: Mapping[str, str], name: str) -> str:
    """A standard header's value, or HeaderMismatch naming the missing header."""
    value = headers.get(name.lower())
    if value is None:
        raise header_mismatch(f"the {name} header is required")
    return value
