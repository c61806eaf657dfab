"""How each model family writes tool calls, which family a chat template speaks, and the
grammar (an xgrammar structural tag) that makes ``required`` and named choices well-formed.

    hermes       (Hermes, Qwen 2.5/3)  <tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>
    llama3_json  (Llama 3.1-3.3)       {"name": "f", "parameters": {...}}; {...}   (optionally
                                        after <|python_tag|>, always at the start of the reply)
    mistral      (Mistral, Nemo)       [TOOL_CALLS][{"name": "f", "arguments": {...}}, {...}]

The grammar writes the family's own syntax (what the model was trained to emit), each call's
arguments held to that function's ``parameters`` schema, one whitespace at most between JSON
tokens; ``parallel_tool_calls: false`` stops it after the first call.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvgate.engine import StructuredOutputs
from kvgate.gateway.function_calls.functions import Function, Functions, ToolChoice


@dataclass(frozen=True)
class Family:
    name: str
    opener: str | None  # text that opens a region of calls anywhere in the reply
    closer: str | None  # text that closes it (None: the region runs to ``]`` or the end)
    bare_start: str | None  # at the very start of the reply this char opens a region too
    skip_prefix: str  # a marker allowed before a bare start (and dropped)
    list_open: str | None  # the calls are a JSON array after the opener
    separator: str  # between calls (besides whitespace)
    arguments_key: str  # where the grammar writes the arguments (the parser takes either)
    call_begin: str  # the grammar's text around one call object
    call_end: str
    short_ids: bool = False  # call ids of 9 letters and digits (Mistral's templates check)

    def constraint(self, tools: Functions) -> StructuredOutputs | None:
        """What holds the reply to calls: None unless the choice is forced."""
        if not tools.choice.forced:
            return None
        tag = self.structural_tag(tools.functions, tools.choice, tools.parallel)
        return StructuredOutputs(structural_tag=tag)

    def structural_tag(
        self, functions: list[Function], choice: ToolChoice, parallel: bool
    ) -> dict[str, Any]:
        """The structural tag for a ``required`` or named choice."""
        chosen = [f for f in functions if choice.mode == "required" or f.name == choice.name]
        tags = [
            {
                "type": "tag",
                "begin": f'{self.call_begin}{{"name": "{f.name}", "{self.arguments_key}": ',
                "content": {
                    "type": "json_schema",
                    "json_schema": f.parameters,
                    "max_whitespace_cnt": 1,
                },
                "end": "}" + self.call_end,
            }
            for f in chosen
        ]
        calls: dict[str, Any] = {
            "type": "tags_with_separator",
            "tags": tags,
            "separator": self.separator + (" " if self.separator.strip() else ""),
            "at_least_one": True,
            "stop_after_first": not parallel or choice.mode == "named",
        }
        if self.list_open is not None:
            calls = {
                "type": "sequence",
                "elements": [
                    {"type": "const_string", "value": (self.opener or "") + self.list_open},
                    calls,
                    {"type": "const_string", "value": "]"},
                ],
            }
        return {"type": "structural_tag", "format": calls}


HERMES = Family(
    "hermes", "<tool_call>", "</tool_call>", None, "", None, "\n", "arguments",
    "<tool_call>\n", "\n</tool_call>",
)  # fmt: skip
LLAMA3_JSON = Family(
    "llama3_json", None, None, "{", "<|python_tag|>", None, ";", "parameters", "", "",
)  # fmt: skip
MISTRAL = Family(
    "mistral", "[TOOL_CALLS]", None, "[", "", "[", ",", "arguments", "", "", short_ids=True,
)  # fmt: skip
FAMILIES = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}
DEFAULT = HERMES  # a template that names no syntax (the tiny model's): the most common one


def detect(template: str) -> Family | None:
    """The family a chat template teaches its model, from the markers it writes."""
    if "<tool_call>" in template:
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if "<|python_tag|>" in template or (
        "<|start_header_id|>" in template and '"parameters"' in template
    ):
        return LLAMA3_JSON
    return None


def resolve(name: str | None, templates: str | dict[str, str] | None) -> Family:
    """``--tool-call-parser NAME`` (ValueError for an unknown one), else the family the
    model's chat template(s) speak (its ``tool_use`` template first), else hermes."""
    if name:
        if name not in FAMILIES:
            raise ValueError(
                f"--tool-call-parser: unknown parser {name!r}; one of {list(FAMILIES)}"
            )
        return FAMILIES[name]
    texts: Iterable[str] = ()
    if isinstance(templates, str):
        texts = [templates]
    elif isinstance(templates, dict):
        texts = sorted(templates.values(), key=lambda t: t != templates.get("tool_use"))
    for text in texts:
        family = detect(text)
        if family is not None:
            return family
    return DEFAULT
