#!/usr/bin/env bash
# A whole kvgate deployment on loopback: a private Redis, 3 kvgate processes sharing it, and
# nginx in front (examples/deploy/nginx.conf); then a smoke test through nginx (or, given
# `-- COMMAND ...`, that command instead, with KVGATE_MCP_URL set to nginx's /mcp), and a clean
# teardown (also on Ctrl-C or failure).
#
#   examples/deploy/run-local.sh            # needs redis-server, nginx (apt-get install nginx)
#   KVGATE_ARGS="--model /models/qwen --kv-cache-dtype fp8" examples/deploy/run-local.sh
#   examples/deploy/run-local.sh -- python benchmarks/deploy_agentic.py   # what the benchmark does
#
# Ports (loopback only, fixed in nginx.conf): nginx 18100, kvgate 18101-18103, Redis 18179.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
NGINX_PORT=18100
KVGATE_PORTS=(18101 18102 18103)
REDIS_PORT=18179
REDIS_URL="redis://127.0.0.1:${REDIS_PORT}/0"
MCP_URL="http://127.0.0.1:${NGINX_PORT}/mcp"
if [[ -x "$ROOT/.venv/bin/kvgate" ]]; then KVGATE=${KVGATE:-"$ROOT/.venv/bin/kvgate"}; fi
KVGATE=${KVGATE:-kvgate}
read -r -a KVGATE_ARGS <<<"${KVGATE_ARGS:-}"  # extra `kvgate serve` flags
PYTHON=$([[ -x "$ROOT/.venv/bin/python" ]] && echo "$ROOT/.venv/bin/python" || echo python3)
READY_TIMEOUT_S=${READY_TIMEOUT_S:-180}
if [[ ${1:-} == -- ]]; then shift; fi
COMMAND=("$@")  # empty: the smoke test
WHAT=$([[ ${#COMMAND[@]} == 0 ]] && echo "smoke test" || echo "command")

WORK=$(mktemp -d /tmp/kvgate-deploy.XXXXXX)
chmod 755 "$WORK"  # nginx workers (an unprivileged user when started as root) write temp files here
PIDS=()
OK=0

log() { printf '\n=== %s\n' "$*"; }

teardown() {
  set +e
  log "teardown"
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for _ in $(seq 100); do
    alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [[ $alive == 0 ]] && break
    sleep 0.1
  done
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  wait 2>/dev/null
  if [[ $OK == 1 ]]; then rm -rf "$WORK"; echo "all stopped; $WHAT PASSED"
  else echo "all stopped; $WHAT FAILED, logs kept in $WORK"; tail -n 20 "$WORK"/*.log; fi
}
trap teardown EXIT
trap 'exit 130' INT TERM

need_free_port() {
  if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then
    echo "port $1 is already in use" >&2
    exit 1
  fi
}

wait_for() {  # wait_for NAME PID COMMAND...: retry COMMAND until it succeeds; fail if PID exits
  local name=$1 pid=$2; shift 2
  local deadline=$((SECONDS + READY_TIMEOUT_S))
  until "$@" >/dev/null 2>&1; do
    if ! kill -0 "$pid" 2>/dev/null; then echo "$name exited" >&2; exit 1; fi
    if ((SECONDS > deadline)); then echo "$name did not come up" >&2; exit 1; fi
    sleep 0.2
  done
  echo "$name is up"
}

# mcp METHOD NAME PARAMS_JSON [CACHE_KEY]: one MCP 2026-07-28 request through nginx; prints
# the process that answered and a digest of the result (an SSE answer: its last event).
mcp() {
  local method=$1 name=$2 params=$3 cache_key=${4:-}
  local headers=(-H 'Content-Type: application/json'
                 -H 'Accept: application/json, text/event-stream'
                 -H 'MCP-Protocol-Version: 2026-07-28'
                 -H "Mcp-Method: $method")
  [[ -n $name ]] && headers+=(-H "Mcp-Name: $name")
  [[ -n $cache_key ]] && headers+=(-H "Mcp-Param-Cache-Key: $cache_key")
  local body
  body=$("$PYTHON" -c '
import json, sys
params = json.loads(sys.argv[2])
params["_meta"] = {
    "io.modelcontextprotocol/protocolVersion": "2026-07-28",
    "io.modelcontextprotocol/clientInfo": {"name": "run-local.sh", "version": "1.0"},
    "io.modelcontextprotocol/clientCapabilities": {},
}
print(json.dumps({"jsonrpc": "2.0", "id": 1, "method": sys.argv[1], "params": params}))
' "$method" "$params")
  curl -sS --max-time 120 -D "$WORK/headers" -o "$WORK/body" "${headers[@]}" -d "$body" "$MCP_URL"
  local upstream
  upstream=$(tr -d '\r' <"$WORK/headers" | awk -F': ' 'tolower($1)=="x-kvgate-upstream"{print $2}')
  echo "$upstream" >>"$WORK/upstreams-${cache_key:-none}"
  "$PYTHON" - "$WORK/body" "$upstream" "$method" <<'PY'
import json, sys
path, upstream, method = sys.argv[1:]
text = open(path).read()
events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
message = json.loads(events[-1] if events else text)
result = message.get("result")
if result is None or result.get("isError"):
    sys.exit(f"FAILED ({upstream}): {json.dumps(message)[:2000]}")
hints = {k: result.get(k) for k in ("ttlMs", "cacheScope") if k in result}
if method == "server/discover":
    digest = {k: result.get(k) for k in ("supportedVersions", "instructions")} | hints
elif method == "tools/list":
    digest = {"tools": [tool["name"] for tool in result["tools"]]} | hints
else:
    digest = result.get("structuredContent", result)
print(f"[{upstream}] {json.dumps(digest)}")
PY
}

for port in "$NGINX_PORT" "${KVGATE_PORTS[@]}" "$REDIS_PORT"; do need_free_port "$port"; done
command -v redis-server >/dev/null || { echo "redis-server is missing (apt-get install redis-server)" >&2; exit 1; }
if ! command -v nginx >/dev/null; then
  log "installing nginx"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx >/dev/null
fi

log "redis on $REDIS_URL"
start_redis() {
  redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --save "" --appendonly no --dir "$WORK" \
    >>"$WORK/redis.log" 2>&1 &
  REDIS_PID=$!
  PIDS+=("$REDIS_PID")
  wait_for redis "$REDIS_PID" redis-cli -p "$REDIS_PORT" ping
}
start_redis

log "3 kvgate processes: ${KVGATE_PORTS[*]}"
CATALOG_CONFIG="$WORK/catalog.json"  # shared by the processes (in Kubernetes: a ConfigMap)
echo '{"instructions": "kvgate behind nginx, catalog one."}' >"$CATALOG_CONFIG"
ADMIN_KEY=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
declare -A KVGATE_PID
for port in "${KVGATE_PORTS[@]}"; do
  KVGATE_ADMIN_API_KEY=$ADMIN_KEY "$KVGATE" serve --host 127.0.0.1 --port "$port" \
    --redis-url "$REDIS_URL" --catalog-config "$CATALOG_CONFIG" \
    ${KVGATE_ARGS[@]+"${KVGATE_ARGS[@]}"} >"$WORK/kvgate-$port.log" 2>&1 &
  KVGATE_PID[$port]=$!
  PIDS+=($!)
done
for port in "${KVGATE_PORTS[@]}"; do
  wait_for "kvgate :$port" "${KVGATE_PID[$port]}" curl -sf "http://127.0.0.1:$port/readyz"
done

log "nginx on 127.0.0.1:$NGINX_PORT"
mkdir -p "$WORK/nginx/tmp"
nginx -t -q -p "$WORK/nginx" -c "$HERE/nginx.conf"
nginx -p "$WORK/nginx" -c "$HERE/nginx.conf" -g 'daemon off;' >"$WORK/nginx.log" 2>&1 &
PIDS+=($!)
wait_for nginx $! curl -sf "http://127.0.0.1:$NGINX_PORT/healthz"

if [[ ${#COMMAND[@]} -gt 0 ]]; then
  log "${COMMAND[*]}"
  KVGATE_MCP_URL=$MCP_URL "${COMMAND[@]}"
  OK=1
  exit 0
fi

PROMPT="The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. "
PROMPT="$PROMPT$PROMPT$PROMPT$PROMPT Tell me what happens next:"
GENERATE=$("$PYTHON" -c 'import json, sys; print(json.dumps({"name": "generate", "arguments": {
    "prompt": sys.argv[1], "max_tokens": 16, "cache_key": "conversation-42"}}))' "$PROMPT")

log "server/discover (no cache key: round robin)"
mcp server/discover "" '{}'
log "tools/list"
mcp tools/list "" '{}'
log "tools/call generate, 3 times with one cache key: one process, its prefix cache reused"
for _ in 1 2 3; do mcp tools/call generate "$GENERATE" conversation-42; done
log "discovery without a key, 3 more times (round robin spreads them)"
for _ in 1 2 3; do mcp server/discover "" '{}'; done

log "Redis killed: every request still answered (from each process's own cache)"
kill -KILL "$REDIS_PID"
wait "$REDIS_PID" 2>/dev/null || true
for _ in 1 2 3; do mcp tools/list "" '{}'; done
mcp tools/call generate "$GENERATE" conversation-42
log "Redis restarted: the processes reconnect by themselves"
start_redis
sleep 3  # reconnect backoff is at most 2 s

log "catalog change: new config, reloaded on :${KVGATE_PORTS[0]} only; every process follows"
echo '{"instructions": "kvgate behind nginx, catalog two."}' >"$CATALOG_CONFIG"
curl -sS --max-time 5 -X POST -H "Authorization: Bearer $ADMIN_KEY" \
  "http://127.0.0.1:${KVGATE_PORTS[0]}/admin/catalog/reload"
echo
sleep 1
for _ in 1 2 3; do mcp server/discover "" '{}' | tee -a "$WORK/after-change"; done
[[ $(grep -c 'catalog two' "$WORK/after-change") == 3 ]] || { echo "a process missed the change" >&2; exit 1; }

log "summary"
echo "processes answering cache key conversation-42: $(sort -u "$WORK/upstreams-conversation-42" | xargs)"
echo "processes answering requests without a key:    $(sort -u "$WORK/upstreams-none" | xargs)"
echo "discovery cache events per process (shared_hit: served from another process's entry;"
echo "outage/recovered: Redis lost and found again; degraded: answered without Redis):"
for port in "${KVGATE_PORTS[@]}"; do
  echo "  :$port $(curl -sf "http://127.0.0.1:$port/metrics" | grep '^kvgate_discovery_cache[a-z_]*_total{' \
    | sed -E 's/.*event="([a-z_]+)"[^ ]* ([0-9.e+]+)$/\1=\2/' | xargs)"
done
echo "shared Redis after its restart (current version restored; entries refill on near-cache misses):"
redis-cli -p "$REDIS_PORT" --scan --pattern 'kvgate:catalog:*' | sort | sed 's/^/  /'
[[ $(sort -u "$WORK/upstreams-conversation-42" | wc -l) == 1 ]] || { echo "cache key was not pinned" >&2; exit 1; }
OK=1
