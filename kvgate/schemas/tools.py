"""JSON Schemas (2020-12) of the inference tools' arguments and structured results.

Descriptions are written for the model that reads ``tools/list``: each says what a field does
and its bounds, so a rejected call can be fixed from the error alone. Limits that depend on
the loaded model (its context length) are filled in by ``inference_tools``.
"""

from __future__ import annotations

from typing import Any

CACHE_KEY_HEADER = "Cache-Key"

_CACHE_KEY = {
    "type": "string",
    "minLength": 1,
    "maxLength": 256,
    "x-mcp-header": CACHE_KEY_HEADER,
    "description": (
        "Optional conversation or tenant key. Calls that share it are routed to the replica "
        "(and, behind a load balancer, the process) that holds their cached prefix; "
        "mirrored into the Mcp-Param-Cache-Key header."
    ),
}


_MODEL = {
    "type": "string",
    "minLength": 1,
    "maxLength": 256,
    "description": (
        "Optional LoRA adapter to answer with (an id from the OpenAI /v1/models list); the "
        "base model by default."
    ),
}


_TEXT_PART = {
    "type": "object",
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
    "required": ["type", "text"],
}
_TOOL_CALL = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "arguments": {
                    "type": ["object", "string"],
                    "description": "The call's arguments: an object, or its JSON text.",
                },
            },
            "required": ["name", "arguments"],
        },
    },
    "required": ["function"],
}
# An OpenAI-style chat message, as chat templates read it (None-valued keys are dropped
# before rendering, as transformers does).
_CHAT_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {
            "anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}, {"type": "null"}],
            "description": "Text, text parts, or null beside tool_calls.",
        },
        "reasoning": {"type": ["string", "null"], "description": "An earlier reasoning trace."},
        "reasoning_content": {
            "type": ["string", "null"],
            "description": "An earlier reasoning trace (the older name of reasoning).",
        },
        "tool_calls": {
            "type": ["array", "null"],
            "items": _TOOL_CALL,
            "description": "Calls the assistant made.",
        },
        "tool_call_id": {"type": "string", "description": "For role tool: the call answered."},
        "name": {"type": "string", "description": "For role tool: the tool that answered."},
    },
    "required": ["role", "content"],
    "additionalProperties": False,
}
FUNCTION_NAME = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}  # OpenAI's rule
_TOOL = {
    "type": "object",
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "properties": {
                "name": FUNCTION_NAME,
                "description": {"type": "string"},
                "parameters": {"type": "object", "description": "A JSON Schema (type object)."},
                "strict": {"type": "boolean"},
            },
            "required": ["name"],
        },
    },
    "required": ["type", "function"],
}
_CHAT_OPTIONS = {
    "tools": {
        "type": "array",
        "minItems": 1,
        "maxItems": 128,
        "description": "Functions the model may call, in the OpenAI shape "
        '({"type": "function", "function": {"name", "description", "parameters"}}); '
        "they are rendered by the chat template and calls in the reply are returned parsed "
        "in structuredContent.tool_calls.",
        "items": _TOOL,
    },
    "tool_choice": {
        "anyOf": [
            {"enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "properties": {
                    "type": {"const": "function"},
                    "function": {
                        "type": "object",
                        "properties": {"name": FUNCTION_NAME},
                        "required": ["name"],
                    },
                },
                "required": ["type", "function"],
            },
        ],
        "description": "auto (default with tools): the model may call; none: it answers in "
        "text; required, or {type: function, function: {name}}: the reply is a call (held to "
        "the tool's parameters by constrained decoding). Not with json_schema/regex/choice.",
    },
    "parallel_tool_calls": {
        "type": "boolean",
        "default": True,
        "description": "false: at most one call.",
    },
    "chat_template_kwargs": {
        "type": "object",
        "description": 'Extra chat template variables, e.g. {"enable_thinking": false}.',
    },
}


# Constrained decoding: at most one of these per call; the reply then matches it by
# construction (the engine masks every token that could break it).
_STRUCTURED = {
    "json_schema": {
        "type": "object",
        "description": (
            "A JSON Schema the reply must satisfy; the reply is then compact JSON and "
            "structuredContent.json holds it parsed. Not supported: not, if/then/else, "
            "patternProperties, dependent*. Give max_tokens room for the whole value."
        ),
    },
    "regex": {
        "type": "string",
        "minLength": 1,
        "description": "A regular expression the whole reply must match.",
    },
    "choice": {
        "type": "array",
        "minItems": 1,
        "maxItems": 256,
        "items": {"type": "string", "minLength": 1},
        "description": "The reply is exactly one of these strings.",
    },
}


def _sampling(max_model_len: int) -> dict[str, Any]:
    return {
        "max_tokens": {
            "type": "integer",
            "minimum": 1,
            "maximum": max_model_len,
            "default": 64,
            "description": "Most tokens to generate; prompt plus completion must fit the context.",
        },
        "temperature": {
            "type": "number",
            "minimum": 0,
            "maximum": 2,
            "default": 1.0,
            "description": "Sampling temperature; 0 picks the most likely token (greedy).",
        },
        "top_p": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": 1,
            "default": 1.0,
            "description": "Nucleus sampling: keep the smallest token set with this probability mass.",
        },
        "top_k": {
            "type": "integer",
            "minimum": 0,
            "default": 0,
            "description": "Keep only the k most likely tokens; 0 keeps all.",
        },
        "seed": {
            "type": "integer",
            "minimum": 0,
            "description": "Seed for reproducible sampling.",
        },
        "stop": {
            "type": "array",
            "items": {"type": "string", "minLength": 1},
            "maxItems": 8,
            "description": "Strings that end the completion (not included in the text).",
        },
        "cache_key": _CACHE_KEY,
        "model": _MODEL,
        **_STRUCTURED,
    }


# The calls a reply made (arguments parsed, or their text if a reply cut short left them
# unfinished): the shape a later turn sends back in ``messages``.
_TOOL_CALL_OUT = {**_TOOL_CALL, "required": ["id", "type", "function"]}


def _completion_output(kind: str, tool_calls: bool = False) -> dict[str, Any]:
    count = {"type": "integer", "minimum": 0}
    calls: dict[str, Any] = {
        "tool_calls": {
            "type": "array",
            "items": _TOOL_CALL_OUT,
            "description": "With tools: the calls in the reply (text holds the reply as written).",
        },
        "reasoning": {
            "type": "string",
            "description": "With --reasoning-parser: the model's thinking (text is what follows).",
        },
    }
    reasons = ["stop", "length", "tool_calls"] if tool_calls else ["stop", "length"]
    return {
        "type": "object",
        "properties": {
            "text": {"type": "string", "description": f"The generated {kind}."},
            "finish_reason": {
                "type": "string",
                "enum": reasons,
                "description": "stop: end of text or a stop string; length: max_tokens reached"
                + ("; tool_calls: the reply stopped after calling tools." if tool_calls else "."),
            },
            "stop_reason": {
                "type": "string",
                "description": "Why it stopped, when neither the text's end nor a stop string "
                "did (a constraint that allowed nothing more).",
            },
            "prompt_tokens": {**count, "description": "Tokens in the prompt."},
            "completion_tokens": {**count, "description": "Tokens generated."},
            "cached_tokens": {**count, "description": "Prompt tokens served from the KV cache."},
            "model": {"type": "string", "description": "The model that answered."},
            "replica": {
                **count,
                "description": "The engine replica that answered (fleet mode: the upstream's "
                "index in the configured order).",
            },
            "upstream": {"type": "string", "description": "Fleet mode: the upstream's URL."},
            "json": {"description": f"With json_schema: the {kind} parsed (it satisfies it)."},
            **(calls if tool_calls else {}),
        },
        "required": [
            "text",
            "finish_reason",
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
            "model",
            "replica",
        ],
        "additionalProperties": False,
    }


def _completion_tool(
    *, name: str, title: str, description: str, input_name: str, input_schema: dict[str, Any],
    output_kind: str, sampling: dict[str, Any], options: dict[str, Any] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """A text-generating tool: one required input plus the shared sampling arguments (and
    optional ``options``), answered with a completion result. ``generate`` and ``chat``
    differ only in those inputs."""
    return {
        "name": name,
        "title": title,
        "description": description,
        "inputSchema": {
            "type": "object",
            "properties": {input_name: input_schema, **(options or {}), **sampling},
            "required": [input_name],
            "additionalProperties": False,
        },
        "outputSchema": _completion_output(output_kind, tool_calls="tools" in (options or {})),
        "annotations": {"readOnlyHint": True, "openWorldHint": False},
    }


def inference_tools(model_name: str, max_model_len: int) -> list[dict[str, Any]]:
    """The ``Tool`` definitions, in the order ``tools/list`` returns them."""
    sampling = _sampling(max_model_len)
    generate = _completion_tool(
        name="generate",
        title="Generate text",
        description=(
            f"Continue a prompt with {model_name}. Send _meta.progressToken to stream the text "
            "as progress notifications."
        ),
        input_name="prompt",
        input_schema={"type": "string", "minLength": 1, "description": "Text to continue."},
        output_kind="completion",
        sampling=sampling,
    )
    chat = _completion_tool(
        name="chat",
        title="Chat",
        description=(
            f"Answer a conversation with {model_name}, formatted with the model's chat template. "
            "With tools, calls in the reply come back parsed in structuredContent.tool_calls "
            "(tool_choice required or a named function guarantees a well-formed call). "
            "Send _meta.progressToken to stream the reply as progress notifications."
        ),
        input_name="messages",
        input_schema={
            "type": "array",
            "minItems": 1,
            "description": "The conversation so far, oldest first.",
            "items": _CHAT_MESSAGE,
        },
        output_kind="reply",
        sampling=sampling,
        options=_CHAT_OPTIONS,
    )
    tokenize = {
        "name": "tokenize",
        "title": "Tokenize",
        "description": f"Split text into {model_name}'s token ids and count them.",
        "inputSchema": {
            "type": "object",
            "properties": {"text": {"type": "string", "description": "Text to tokenize."}},
            "required": ["text"],
            "additionalProperties": False,
        },
        "outputSchema": {
            "type": "object",
            "properties": {
                "token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                "count": {"type": "integer", "minimum": 0},
                "model": {"type": "string"},
            },
            "required": ["token_ids", "count", "model"],
            "additionalProperties": False,
        },
        "annotations": {"readOnlyHint": True, "idempotentHint": True, "openWorldHint": False},
    }
    return [generate, chat, tokenize]
