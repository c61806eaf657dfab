#!/bin/sh
# POST /v1/chat/completions, as any OpenAI client sends it. "model" may be left out; when
# given it must be the served id (GET /v1/models; --served-model-name), else 404.
BASE=${KVGATE_BASE:-http://127.0.0.1:8000}
curl -sS "$BASE/v1/chat/completions" \
  -H 'Content-Type: application/json' \
  -d '{"max_tokens": 32,
       "messages": [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Tell me about paged KV caches."}]}'
echo
