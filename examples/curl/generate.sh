#!/bin/sh
# tools/call generate: one JSON response with the completion in structuredContent.
# tools/call also needs Mcp-Name, equal to params.name.
URL=${KVGATE_URL:-http://127.0.0.1:8000/mcp}
curl -sS "$URL" \
  -H 'Content-Type: application/json' \
  -H 'Accept: application/json, text/event-stream' \
  -H 'MCP-Protocol-Version: 2026-07-28' \
  -H 'Mcp-Method: tools/call' \
  -H 'Mcp-Name: generate' \
  -d '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "generate",
        "arguments": {"prompt": "Once upon a time", "max_tokens": 32},
        "_meta": {
          "io.modelcontextprotocol/protocolVersion": "2026-07-28",
          "io.modelcontextprotocol/clientInfo": {"name": "curl", "version": "1.0"},
          "io.modelcontextprotocol/clientCapabilities": {}}}}'
echo
