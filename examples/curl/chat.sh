#!/bin/sh
# tools/call chat with a cache_key: its schema marks it "x-mcp-header": "Cache-Key", so the
# value is mirrored into Mcp-Param-Cache-Key (a load balancer can hash on it to keep one
# conversation on the processes that hold its KV cache). Header and body must agree.
URL=${KVGATE_URL:-http://127.0.0.1:8000/mcp}
curl -sS "$URL" \
  -H 'Content-Type: application/json' \
  -H 'Accept: application/json, text/event-stream' \
  -H 'MCP-Protocol-Version: 2026-07-28' \
  -H 'Mcp-Method: tools/call' \
  -H 'Mcp-Name: chat' \
  -H 'Mcp-Param-Cache-Key: conversation-42' \
  -d '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "chat",
        "arguments": {
          "messages": [{"role": "user", "content": "Tell me a short story."}],
          "max_tokens": 32,
          "cache_key": "conversation-42"},
        "_meta": {
          "io.modelcontextprotocol/protocolVersion": "2026-07-28",
          "io.modelcontextprotocol/clientInfo": {"name": "curl", "version": "1.0"},
          "io.modelcontextprotocol/clientCapabilities": {}}}}'
echo
