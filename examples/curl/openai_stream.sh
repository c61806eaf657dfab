#!/bin/sh
# POST /v1/completions streamed: `data: {chunk}` lines, usage last, then `data: [DONE]`.
BASE=${KVGATE_BASE:-http://127.0.0.1:8000}
curl -sS -N "$BASE/v1/completions" \
  -H 'Content-Type: application/json' \
  -d '{"prompt": "Once upon a time", "max_tokens": 32, "stream": true,
       "stream_options": {"include_usage": true}}'
