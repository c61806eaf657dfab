"""A ``/v1/responses`` body → a chat ``GenerationRequest``, checked as vLLM checks it.

The Responses API is a chat by another shape: ``instructions`` become the system message,
``input`` (a string, or message / ``function_call`` / ``function_call_output`` items) the
conversation — a call the model made is an assistant turn's ``tool_calls``, its output a
``tool`` message, as the chat template expects them —, the flat function ``tools``
(``{type, name, parameters, strict}``) and ``tool_choice`` the chat's ``Functions`` (the same
forced-call grammar), ``text.format`` the same structured outputs, ``max_output_tokens`` the
``max_tokens`` (a ``text.format`` beside a forced call is set aside: the reply is only
calls). Earlier ``reasoning`` items are dropped (templates drop earlier thinking).
Only function tools are served: another tool type is a 400 naming it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.engine.sampling_params import StructuredOutputs
from kvgate.gateway.calls.errors import BadInput
from kvgate.gateway.function_calls.functions import Functions
from kvgate.gateway.openai import requests as parse

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
PASSED_ON = (  # the OpenAI fields, and vLLM's sampling extras
    "temperature", "top_p", "top_k", "seed", "stream", "stop", "repetition_penalty",
    "min_tokens", "ignore_eos",
)  # fmt: skip


@dataclass(frozen=True)
class ResponsesAsk:
    """What a ``/v1/responses`` body asks, parsed."""

    input: list[dict[str, Any]]  # the conversation it adds (chat messages), instructions apart
    instructions: str | None
    sampling: parse.Sampling
    functions: Functions | None
    store: bool
    previous_response_id: str | None
    echo: dict[str, Any]  # the request fields a Response repeats back


def read(body: dict[str, Any]) -> ResponsesAsk:
    instructions = parse._get(body, "instructions", (str,), "a string")
    max_output = parse._integer(body, "max_output_tokens")
    parse._in_range("max_output_tokens", max_output, 1, float("inf"), ">= 1")
    fields = {k: body[k] for k in PASSED_ON if k in body}
    if max_output is not None:
        fields["max_tokens"] = max_output
    sampling = parse.sampling(fields, chat=True)
    structured = text_format(body.get("text"))
    tools, tool_choice = chat_tools(body.get("tools")), chat_tool_choice(body.get("tool_choice"))
    functions = Functions.of(tools, tool_choice, body.get("parallel_tool_calls"))
    # A forced call's reply has no text to format: agents send their output type's format
    # with every turn, forced calls included (the chat route refuses the two together).
    if structured is not None and not (functions is not None and functions.choice.forced):
        sampling.fields["structured_outputs"] = structured
    store = parse._get(body, "store", (bool,), "a boolean")
    previous = parse._get(body, "previous_response_id", (str,), "a string")
    metadata = parse._get(body, "metadata", (dict,), "an object")
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_output,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": functions.parallel if functions is not None else True,
        "text": body.get("text") or {"format": {"type": "text"}},
        "metadata": metadata,
    }
    return ResponsesAsk(
        conversation(body.get("input")),
        instructions,
        sampling,
        functions,
        bool(store),
        previous,
        echo,
    )


def conversation(raw: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive calls join one assistant turn."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise BadInput("'input' must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise BadInput(f"'{where}' must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise BadInput(f"'{where}.call_id' must be a string", f"{where}.call_id")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call_id,
                    "content": _text(output, f"{where}.output"),
                }
            )
        elif kind != "reasoning":
            raise BadInput(
                f"'{where}.type' {kind!r} is not served: one of message, function_call, "
                "function_call_output, reasoning",
                f"{where}.type",
            )
    if not messages:
        raise BadInput("'input' has no message, call or call output", "input")
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise BadInput(
            f"'{where}.role' must be one of {list(ROLES)}, got {role!r}", f"{where}.role"
        )
    return {"role": role, "content": _text(item.get("content"), f"{where}.content")}


def _text(content: Any, where: str) -> str:
    """A string, or text parts joined (this model reads text)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") in TEXT_PARTS):
                raise BadInput(
                    f"'{where}[{j}]' must be a text part ({', '.join(TEXT_PARTS)}): this model "
                    "reads text",
                    where,
                )
            if not isinstance(part.get("text"), str):
                raise BadInput(f"'{where}[{j}].text' must be a string", where)
            texts.append(part["text"])
        return "\n".join(texts)
    raise BadInput(f"'{where}' must be a string or a list of text parts", where)


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise BadInput(f"'{where}.{key}' must be a string", f"{where}.{key}")
    function = {"name": item["name"], "arguments": item["arguments"]}
    return {"id": item["call_id"], "type": "function", "function": function}


def chat_tools(raw: Any) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in the chat shape (what templates render)."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise BadInput("'tools' must be a list of function tools", "tools")
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise BadInput(
                f"'tools[{i}].type' must be 'function' (only function tools are served), "
                f"got {kind!r}",
                f"tools[{i}].type",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        if function.get("description") is None:
            function.pop("description", None)
        tools.append({"type": "function", "function": function})
    return tools


def chat_tool_choice(raw: Any) -> Any:
    """``{"type": "function", "name": f}`` in the chat shape; the modes as they are."""
    if isinstance(raw, dict) and raw.get("type") == "function" and "function" not in raw:
        return {"type": "function", "function": {"name": raw.get("name")}}
    return raw


def text_format(raw: Any) -> StructuredOutputs | None:
    """``text.format``: ``text`` (none), ``json_object``, or ``json_schema`` with ``schema``."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadInput("'text' must be an object", "text")
    form = raw.get("format")
    if form is None:
        return None
    kind = form.get("type") if isinstance(form, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        schema = form.get("schema")
        if not isinstance(schema, dict):
            raise BadInput(
                "'text.format.schema' must be a JSON Schema object", "text.format.schema"
            )
        name = form.get("name")
        if not isinstance(name, str) or not name:
            raise BadInput("'text.format.name' must be a non-empty string", "text.format.name")
        return StructuredOutputs(json=schema)
    raise BadInput(
        f"'text.format.type' must be one of text, json_object, json_schema, got {kind!r}",
        "text.format.type",
    )
