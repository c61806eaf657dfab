#!/bin/sh
# POST /v1/chat/completions with a tool: tool_choice "required" makes the reply a call whose
# arguments fit the tool's parameters (the random tiny model included); "auto" lets the model
# choose. The answer's message.tool_calls holds the call, finish_reason is "tool_calls".
BASE=${KVGATE_BASE:-http://127.0.0.1:8000}
curl -sS "$BASE/v1/chat/completions" \
  -H 'Content-Type: application/json' \
  -d '{"max_tokens": 200, "tool_choice": "required", "parallel_tool_calls": false,
       "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
       "tools": [{"type": "function", "function": {
         "name": "get_weather", "description": "Current weather in a city",
         "parameters": {"type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 12},
                                       "unit": {"enum": ["celsius", "fahrenheit"]}},
                        "required": ["city", "unit"], "additionalProperties": false}}}]}'
echo
