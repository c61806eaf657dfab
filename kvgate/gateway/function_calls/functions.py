"""A chat request's ``tools`` and ``tool_choice``, checked as the OpenAI API defines them.

Bad input is a ``FunctionsError`` (a ``BadInput``) naming the field (each front door words it: a 400, a tool
error). ``tool_choice`` defaults to ``auto`` with tools and ``none`` without; a named or
``required`` choice needs the tools it names. Assistant turns with ``tool_calls`` whose
arguments are JSON text get them as objects, as vLLM hands them to chat templates (which
write ``arguments | tojson``); arguments that are not JSON (a call cut short by max_tokens, kept
in an agent's history) become ``{}`` with a warning, as vLLM does, so the conversation goes on.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
import orjson
from jsonschema_specifications import REGISTRY as META_SCHEMAS

from kvgate.gateway.calls.errors import BadInput
from kvgate.schemas.tools import FUNCTION_NAME

log = logging.getLogger("kvgate.function_calls")

NAME = re.compile(FUNCTION_NAME["pattern"])  # OpenAI's rule for function names
MAX_TOOLS = 128
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
DRAFT_2020_12 = jsonschema.Draft202012Validator


class FunctionsError(BadInput):
    """A bad ``tools``, ``tool_choice``, ``parallel_tool_calls`` or earlier call; ``field``
    names it."""


@dataclass(frozen=True)
class Function:
    name: str
    parameters: dict[str, Any]  # a JSON Schema for the arguments object


@dataclass(frozen=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None  # the function, when named

    @property
    def forced(self) -> bool:
        """A grammar holds the output to a call (``auto`` parses whatever comes)."""
        return self.mode in ("required", "named")

    @property
    def wire(self) -> str | dict[str, Any]:
        """The choice as the OpenAI API writes it."""
        if self.mode == "named":
            return {"type": "function", "function": {"name": self.name}}
        return self.mode


@dataclass(frozen=True)
class Functions:
    """What a chat call asks of tools, whichever front door it came through."""

    raw: list[dict[str, Any]]  # the tools as given: what the chat template renders
    functions: list[Function]
    choice: ToolChoice
    parallel: bool  # more than one call may be made
    chars: int = 0  # the tools' JSON size: what rendering them into a prompt chews through

    @classmethod
    def of(cls, tools: Any, tool_choice: Any, parallel: Any) -> Functions | None:
        """None without tools; a ``FunctionsError`` naming the field when something is bad."""
        if parallel is not None and not isinstance(parallel, bool):
            raise FunctionsError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
        functions = [] if tools is None else parse_tools(tools)
        choice = parse_tool_choice(tool_choice, functions)
        if tools is None:
            return None
        return cls(tools, functions, choice, parallel is not False, _json_size(tools))

    @property
    def parsed(self) -> bool:
        """Calls are read out of the reply (``none``: the tools are only rendered)."""
        return self.choice.mode != "none"

    def openai_fields(self) -> dict[str, Any]:
        """The request's tool fields as the OpenAI API writes them (for an upstream server,
        which renders and parses the calls itself)."""
        return {
            "tools": self.raw,
            "tool_choice": self.choice.wire,
            "parallel_tool_calls": self.parallel,
        }


def _json_size(value: Any) -> int:
    try:
        return len(orjson.dumps(value))
    except orjson.JSONEncodeError:  # an integer past 64 bits, say: any estimate will do
        return len(repr(value))


def parse_tools(raw: Any) -> list[Function]:
    """``tools``: ``[{"type": "function", "function": {name, description?, parameters?,
    strict?}}]``; ``parameters`` must be a valid JSON Schema object."""
    if not isinstance(raw, list) or not raw or len(raw) > MAX_TOOLS:
        raise FunctionsError(f"'tools' must be a list of 1 to {MAX_TOOLS} tools", "tools")
    functions: list[Function] = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise FunctionsError(f"'{where}.type' must be 'function'", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise FunctionsError(f"'{where}.function' must be an object", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise FunctionsError(
                f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-', got {name!r}",
                f"{where}.function.name",
            )
        if any(f.name == name for f in functions):
            raise FunctionsError(f"'{where}.function.name': {name!r} is given twice", "tools")
        if not isinstance(function.get("description", ""), str):
            raise FunctionsError(
                f"'{where}.function.description' must be a string", f"{where}.function"
            )
        functions.append(Function(name, _parameters(function.get("parameters"), where)))
    return functions


def _parameters(schema: Any, where: str) -> dict[str, Any]:
    field = f"{where}.function.parameters"
    if schema is None:
        return NO_PARAMETERS
    if not isinstance(schema, dict):
        raise FunctionsError(f"'{field}' must be a JSON Schema object", field)
    draft = jsonschema.validators.validator_for(schema)
    if draft is DRAFT_2020_12:  # the usual case, 5-6x faster than ``check_schema``
        error = next(iter(META_CHECK.iter_errors(schema)), None)
    else:
        try:
            draft.check_schema(schema)
            error = None
        except jsonschema.SchemaError as exc:
            error = exc
    if error is not None:
        path = "/".join(str(p) for p in error.absolute_path)
        message = f"'{field}' is not a valid JSON Schema at '/{path}': {error.message}"
        raise FunctionsError(message, field) from None
    if schema.get("type", "object") != "object":
        raise FunctionsError(f"'{field}' must describe an object (type 'object')", field)
    return schema


def _flat_meta_schema() -> dict[str, Any]:
    """The 2020-12 meta-schema as one document: its seven vocabularies' ``properties`` and
    ``$defs`` merged into one object, ``$dynamicRef: #meta`` as ``$ref: #`` (what it resolves
    to when nothing extends the meta-schema). It accepts and refuses what the original does,
    with the same errors, without the dynamic-scope walk per node that made checking 1 MiB
    of tool schemas take several seconds."""
    root = DRAFT_2020_12.META_SCHEMA
    base = root["$id"].rsplit("/", 1)[0] + "/"
    parts = [META_SCHEMAS.contents(base + part["$ref"]) for part in root["allOf"]] + [root]
    flat: dict[str, Any] = {
        "$id": "urn:kvgate:meta-schema:2020-12",
        "type": ["object", "boolean"],
        "properties": {},
        "$defs": {},
    }
    for part in parts:
        for key in ("properties", "$defs"):
            for name, value in part.get(key, {}).items():
                assert name not in flat[key], name  # the vocabularies define disjoint names
                flat[key][name] = _local_refs(value)
    return flat


def _local_refs(node: Any) -> Any:
    if isinstance(node, list):
        return [_local_refs(v) for v in node]
    if not isinstance(node, dict):
        return node
    if node == {"$dynamicRef": "#meta"}:
        return {"$ref": "#"}
    out = {k: _local_refs(v) for k, v in node.items()}
    ref = out.get("$ref")
    if isinstance(ref, str) and ref.startswith("meta/"):  # "meta/validation#/$defs/x"
        out["$ref"] = "#" + ref.partition("#")[2]
    return out


META_CHECK = DRAFT_2020_12(_flat_meta_schema(), format_checker=DRAFT_2020_12.FORMAT_CHECKER)


def parse_tool_choice(raw: Any, functions: list[Function]) -> ToolChoice:
    """``none`` | ``auto`` | ``required`` | ``{"type": "function", "function": {"name"}}``."""
    if raw is None:
        return ToolChoice("auto" if functions else "none")
    if raw in ("none", "auto", "required"):
        if raw != "none" and not functions:
            raise FunctionsError(f"'tool_choice' {raw!r} needs 'tools'", "tool_choice")
        return ToolChoice(raw)
    if isinstance(raw, dict) and raw.get("type") == "function":
        name = (
            raw.get("function", {}).get("name") if isinstance(raw.get("function"), dict) else None
        )
        if not isinstance(name, str):
            raise FunctionsError("'tool_choice.function.name' must be a string", "tool_choice")
        if not any(f.name == name for f in functions):
            known = [f.name for f in functions]
            raise FunctionsError(
                f"'tool_choice' names function {name!r}, which is not in 'tools' ({known})",
                "tool_choice",
            )
        return ToolChoice("named", name)
    raise FunctionsError(
        "'tool_choice' must be 'none', 'auto', 'required' or "
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with each earlier call's arguments as an object (copies only the
    assistant turns it changes)."""
    out = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            message = {**message, "tool_calls": [_call(c, i, j) for j, c in enumerate(calls)]}
        out.append(message)
    return out


def _call(call: Any, i: int, j: int) -> Any:
    where = f"messages[{i}].tool_calls[{j}]"
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise FunctionsError(f"'{where}.function.name' must be a string", f"{where}.function")
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):  # not JSON, or nested past the parser's stack
            # A call cut short by max_tokens ('{"a":') stays in an agent's history; as vLLM
            # does, the next turn renders it with no arguments rather than refusing the turn.
            log.warning("%s.function.arguments is not JSON text: rendered as {}", where)
            arguments = {}
    elif arguments is None:
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments}}
