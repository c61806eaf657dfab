"""Which protocol revisions this server speaks, and which era a request belongs to.

The era is decided by the ``MCP-Protocol-Version`` header, as the official SDKs do: a modern
revision gets the stateless per-request rules, a legacy revision (or no header at all, read
as 2025-03-26) gets the handshake-era rules, anything else is refused with the list.
"""

from __future__ import annotations

from enum import Enum

from kvgate.protocol.errors import UNSUPPORTED_PROTOCOL_VERSION, ProtocolError

MODERN_VERSIONS = ("2026-07-28",)
LEGACY_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26")
SUPPORTED_VERSIONS = MODERN_VERSIONS + LEGACY_VERSIONS
LATEST_LEGACY_VERSION = LEGACY_VERSIONS[0]


class Era(Enum):
    MODERN = "modern"
    LEGACY = "legacy"


def unsupported_version(requested: object) -> ProtocolError:
    return ProtocolError(
        UNSUPPORTED_PROTOCOL_VERSION,
        "Unsupported protocol version",
        data={"supported": list(SUPPORTED_VERSIONS), "requested": requested},
    )


def era_of(header_version: str | None) -> Era:
    """The era of a request whose ``MCP-Protocol-Version`` header is ``header_version``
    (None when absent: read as 2025-03-26, a legacy revision)."""
    if header_version is None or header_version in LEGACY_VERSIONS:
        return Era.LEGACY
    if header_version in MODERN_VERSIONS:
        return Era.MODERN
    raise unsupported_version(header_version)


def negotiate_legacy(requested: object) -> str:
    """The version to answer an ``initialize`` with: the client's if we speak it, else ours."""
    if isinstance(requested, str) and requested in LEGACY_VERSIONS:
        return requested
    return LATEST_LEGACY_VERSION
