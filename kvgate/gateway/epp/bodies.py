"""A request body as the call fleet mode would route: OpenAI and MCP bodies read into a
``GenerationRequest`` by the doors' own readers.

The picker never answers the call, so only what routing reads is kept: the prompt or the
conversation (and, for a tokenizer's key, the tools and template variables), the cache key and
salt, the adapter. Everything comes from the functions the doors parse with
(``openai.requests``, ``function_calls.template_messages``, the MCP tools' argument names), so
the keys ``Fleet.decide`` computes are the ones a gateway in fleet mode computes for the same
body. A body that is not one of these calls, or that the door would refuse, routes without a
key (least loaded): the upstream answers it in its own words.
"""

from __future__ import annotations

from typing import Any

import orjson

from kvgate.engine.sampling_params import SamplingParams
from kvgate.gateway.calls.errors import CallError
from kvgate.gateway.function_calls.functions import Functions, FunctionsError, template_messages
from kvgate.gateway.generation import GenerationRequest
from kvgate.gateway.openai import requests as parse

KEYLESS = GenerationRequest(SamplingParams(), prompt="")  # no prompt: least loaded
PARAMS = SamplingParams()  # sampling does not route: one shared value
MCP_TOOLS = ("generate", "chat")  # the tools that generate (kvgate.gateway.mcp.tool_runner)


def read(path: str, body: bytes, model_name: str) -> GenerationRequest:
    """The call ``body`` sent to ``path`` asks for, as routing reads it (``KEYLESS`` when
    it asks for no generation or would be refused)."""
    try:
        fields = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return KEYLESS
    if not isinstance(fields, dict):
        return KEYLESS
    route = path.split("?", 1)[0]
    try:
        if route.endswith("/chat/completions"):
            return _chat(fields, model_name)
        if route.endswith("/completions"):
            return _completion(fields, model_name)
        if route.endswith("/mcp"):
            return _tool_call(fields, model_name)
    except (CallError, FunctionsError, KeyError, TypeError, ValueError):
        return KEYLESS
    return KEYLESS


def _text(fields: dict[str, Any], name: str) -> str | None:
    value = fields.get(name)
    return value if isinstance(value, str) else None


def _chat(fields: dict[str, Any], model_name: str) -> GenerationRequest:
    """As ``OpenAIEndpoint._read_chat`` reads it."""
    kwargs = fields.get("chat_template_kwargs")
    return GenerationRequest(
        PARAMS,
        messages=template_messages(parse.chat_messages(fields)),
        functions=parse.chat_functions(fields) if "tools" in fields else None,
        chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
        cache_key=_text(fields, "cache_key"),
        cache_salt=_text(fields, "cache_salt"),
        adapter=parse.check_model(fields, model_name),
    )


def _completion(fields: dict[str, Any], model_name: str) -> GenerationRequest:
    """As ``OpenAIEndpoint._read_completions`` reads it; a list of prompts goes where its
    first would (fleet mode routes each on its own; one request has one destination)."""
    return GenerationRequest(
        PARAMS,
        prompt=parse.completion_prompts(fields)[0],
        cache_key=_text(fields, "cache_key"),
        cache_salt=_text(fields, "cache_salt"),
        adapter=parse.check_model(fields, model_name),
    )


def _tool_call(fields: dict[str, Any], model_name: str) -> GenerationRequest:
    """As ``ToolRunner._request`` reads a ``tools/call`` of ``generate`` or ``chat``."""
    params = fields.get("params")
    if fields.get("method") != "tools/call" or not isinstance(params, dict):
        return KEYLESS
    arguments = params.get("arguments")
    if params.get("name") not in MCP_TOOLS or not isinstance(arguments, dict):
        return KEYLESS
    messages = arguments.get("messages")
    prompt = arguments.get("prompt")
    if isinstance(messages, list) and messages:
        prompt = None
    elif isinstance(prompt, str | list):
        messages = None
    else:
        return KEYLESS
    model = arguments.get("model")
    kwargs = arguments.get("chat_template_kwargs")
    return GenerationRequest(
        PARAMS,
        prompt=prompt,
        messages=None if messages is None else template_messages(messages),
        functions=Functions.of(
            arguments.get("tools"),
            arguments.get("tool_choice"),
            arguments.get("parallel_tool_calls"),
        )
        if "tools" in arguments
        else None,
        chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
        cache_key=_text(arguments, "cache_key"),
        adapter=None if model == model_name or not isinstance(model, str) else model,
    )
