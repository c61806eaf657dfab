"""MCP over JSON-RPC, as pure rules: parsing, eras, header checks, method table, result shapes.

No sockets, no engine: the gateway feeds bytes and header mappings in and gets messages,
errors (with their HTTP status) and shaped results out.
"""
