"""The modern (2026-07-28) request ladder: envelope fields, then headers against the body.

Order matters and follows the official SDK: a request without the required ``_meta`` fields is
malformed (-32602); a client whose headers disagree with its own body is told so (-32020)
before anything else; only then is the method looked up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvgate.protocol.errors import header_mismatch, invalid_params
from kvgate.protocol.headers import decode_header_value, require_header
from kvgate.protocol.jsonrpc_types import Message
from kvgate.protocol.methods import NAME_BEARING

PROTOCOL_VERSION_KEY = "io.modelcontextprotocol/protocolVersion"
CLIENT_CAPABILITIES_KEY = "io.modelcontextprotocol/clientCapabilities"
CLIENT_INFO_KEY = "io.modelcontextprotocol/clientInfo"
LOG_LEVEL_KEY = "io.modelcontextprotocol/logLevel"
SERVER_INFO_KEY = "io.modelcontextprotocol/serverInfo"
SUBSCRIPTION_ID_KEY = "io.modelcontextprotocol/subscriptionId"


@dataclass(frozen=True, slots=True)
class ModernRequest:
    """What the per-request envelope declared."""

    protocol_version: str
    client_capabilities: Mapping[str, Any]


def check_modern_request(message: Message, headers: Mapping[str, str]) -> ModernRequest:
    """Validate envelope and mirrored headers; ``headers`` must look up lower-case names."""
    meta = message.params.get("_meta")
    if not isinstance(meta, dict):
        raise invalid_params(
            f"params._meta must be an object carrying {PROTOCOL_VERSION_KEY!r} "
            f"and {CLIENT_CAPABILITIES_KEY!r}"
        )
    missing = [key for key in (PROTOCOL_VERSION_KEY, CLIENT_CAPABILITIES_KEY) if key not in meta]
    if missing:
        raise invalid_params(f"params._meta is missing the required key(s): {', '.join(missing)}")
    version = meta[PROTOCOL_VERSION_KEY]
    capabilities = meta[CLIENT_CAPABILITIES_KEY]
    if not isinstance(capabilities, dict):
        raise invalid_params(f"params._meta[{CLIENT_CAPABILITIES_KEY!r}] must be an object")
    if require_header(headers, "MCP-Protocol-Version") != version:
        raise header_mismatch("MCP-Protocol-Version header does not match params._meta")
    if require_header(headers, "Mcp-Method") != message.method:
        raise header_mismatch("Mcp-Method header does not match the body's method")
    name_key = NAME_BEARING.get(message.method)
    if name_key is not None:
        name = decode_header_value(require_header(headers, "Mcp-Name"))
        if name != message.params.get(name_key):
            raise header_mismatch(f"Mcp-Name header does not match the body's {name_key!r}")
    return ModernRequest(protocol_version=version, client_capabilities=capabilities)


def check_legacy_meta(message: Message, header_version: str | None) -> None:
    """A ``_meta`` protocol version that differs from the (legacy or missing) header is a
    client disagreeing with itself."""
    declared = message.meta.get(PROTOCOL_VERSION_KEY)
    if declared is not None and declared != header_version:
        raise header_mismatch(
            "params._meta declares a protocol version the MCP-Protocol-Version header does not"
        )
