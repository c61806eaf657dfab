"""MCP over JSON-RPC, as pure rules: parsing, eras, header checks, method table, result shapes.

No sockets, no engine: the gateway feeds bytes and header mappings in and gets messages,
errors (with their HTTP status) and shaped results out.
"""

from kvgate.protocol.errors import ProtocolError
from kvgate.protocol.jsonrpc import encode_error, encode_result, parse_message, splice_result
from kvgate.protocol.jsonrpc_types import Message, RequestId
from kvgate.protocol.versions import SUPPORTED_VERSIONS, Era, era_of

__all__ = [
    "SUPPORTED_VERSIONS",
    "Era",
    "Message",
    "ProtocolError",
    "RequestId",
    "encode_error",
    "encode_result",
    "era_of",
    "parse_message",
    "splice_result",
]
