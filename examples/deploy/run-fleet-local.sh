#!/usr/bin/env bash
# Fleet mode on loopback: 3 kvgate engine processes as upstreams and 2 kvgate gateways in fleet
# mode (`--upstream` each), then a smoke test: both gateways send a session to the same upstream,
# /readyz lists the upstreams, the OpenAI API answers through a gateway; clean teardown.
#
#   examples/deploy/run-fleet-local.sh
#   UPSTREAM_ARGS="--model /models/qwen" examples/deploy/run-fleet-local.sh
#
# Ports (loopback): gateways 18200 and 18210, upstreams 18201-18203.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
PYTHON=${PYTHON:-$([[ -x "$ROOT/.venv/bin/python" ]] && echo "$ROOT/.venv/bin/python" || echo python3)}
KVGATE=(${KVGATE:-"$PYTHON" -m kvgate})
read -r -a UPSTREAM_ARGS <<<"${UPSTREAM_ARGS:---kv-cache-memory 64MiB}"
UPSTREAM_PORTS=(18201 18202 18203)
GATEWAY_PORTS=(18200 18210)
WORK=$(mktemp -d /tmp/kvgate-fleet.XXXXXX)
PIDS=()
OK=0

teardown() {
  set +e
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  wait 2>/dev/null
  if [[ $OK == 1 ]]; then rm -rf "$WORK"; echo "all stopped; smoke test PASSED"
  else echo "all stopped; smoke test FAILED, logs kept in $WORK"; tail -n 20 "$WORK"/*.log; fi
}
trap teardown EXIT
trap 'exit 130' INT TERM

wait_ready() {  # wait_ready PORT PID
  local deadline=$((SECONDS + 180))
  until curl -sf "http://127.0.0.1:$1/readyz" >/dev/null; do
    kill -0 "$2" 2>/dev/null || { echo "port $1: process exited" >&2; exit 1; }
    ((SECONDS < deadline)) || { echo "port $1 did not come up" >&2; exit 1; }
    sleep 0.2
  done
  echo "127.0.0.1:$1 is ready"
}

cd "$ROOT"
UPSTREAM_FLAGS=()
for port in "${UPSTREAM_PORTS[@]}"; do
  "${KVGATE[@]}" serve --port "$port" "${UPSTREAM_ARGS[@]}" >"$WORK/upstream-$port.log" 2>&1 &
  PIDS+=($!)
  UPSTREAM_FLAGS+=(--upstream "http://127.0.0.1:$port")
done
for i in "${!UPSTREAM_PORTS[@]}"; do wait_ready "${UPSTREAM_PORTS[$i]}" "${PIDS[$i]}"; done
for port in "${GATEWAY_PORTS[@]}"; do
  "${KVGATE[@]}" serve --port "$port" "${UPSTREAM_FLAGS[@]}" >"$WORK/gateway-$port.log" 2>&1 &
  PIDS+=($!)
  wait_ready "$port" "${PIDS[-1]}"
done

generate() {  # generate PORT CACHE_KEY: the upstream that answered
  curl -sf "http://127.0.0.1:$1/mcp" \
    -H 'Content-Type: application/json' -H 'Accept: application/json, text/event-stream' \
    -H 'MCP-Protocol-Version: 2026-07-28' -H 'Mcp-Method: tools/call' -H 'Mcp-Name: generate' \
    -H "Mcp-Param-Cache-Key: $2" \
    -d '{"jsonrpc":"2.0","id":1,"method":"tools/call","params":{"name":"generate",
         "arguments":{"prompt":"Hello fleet","max_tokens":4,"cache_key":"'"$2"'"},
         "_meta":{"io.modelcontextprotocol/protocolVersion":"2026-07-28",
                  "io.modelcontextprotocol/clientInfo":{"name":"smoke","version":"1"},
                  "io.modelcontextprotocol/clientCapabilities":{}}}}' |
    "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["result"]["structuredContent"]["upstream"])'
}

for session in alice bob carol; do
  a=$(generate "${GATEWAY_PORTS[0]}" "$session")
  b=$(generate "${GATEWAY_PORTS[1]}" "$session")
  echo "session $session: gateway 1 -> $a, gateway 2 -> $b"
  [[ "$a" == "$b" ]] || { echo "the gateways disagree" >&2; exit 1; }
done
curl -sf "http://127.0.0.1:${GATEWAY_PORTS[0]}/readyz"; echo
curl -sf "http://127.0.0.1:${GATEWAY_PORTS[1]}/v1/completions" -H 'Content-Type: application/json' \
  -d '{"prompt":"Hello","max_tokens":4}' | "$PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["choices"][0])'
OK=1
