#!/bin/sh
# server/discover (MCP 2026-07-28): supported versions, capabilities, server identity.
# Every request carries the version both as a header and in _meta, plus Mcp-Method.
URL=${KVGATE_URL:-http://127.0.0.1:8000/mcp}
curl -sS "$URL" \
  -H 'Content-Type: application/json' \
  -H 'Accept: application/json, text/event-stream' \
  -H 'MCP-Protocol-Version: 2026-07-28' \
  -H 'Mcp-Method: server/discover' \
  -d '{"jsonrpc": "2.0", "id": 1, "method": "server/discover", "params": {"_meta": {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientInfo": {"name": "curl", "version": "1.0"},
        "io.modelcontextprotocol/clientCapabilities": {}}}}'
echo
