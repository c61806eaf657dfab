"""``chat``'s ``tools`` / ``tool_choice`` / ``parallel_tool_calls``: the constraint a forced
choice adds, and the calls read out of the reply for ``structuredContent.tool_calls`` (the
arguments parsed into objects; the text as written if a reply cut short left it unfinished).
``tool_choice: none`` renders the tools and returns no calls, as on the OpenAI route. In fleet
mode (no ``family``) the upstream constrains and reads the calls; they are mapped the same way."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine import StructuredOutputs
from gateway.function_calls import parser
from gateway.function_calls.formats import Family
from gateway.function_calls.functions import Functions
from gateway.generation import Completion


@dataclass(frozen=True)
class ToolUse:
    tools: Functions
    family: Family | None  # None: the backend reads the calls itself

    @classmethod
    def of(cls, arguments: Mapping[str, Any], family: Family | None) -> ToolUse | None:
        """None without tools; ValueError (a ``FunctionsError`` naming the field) when bad."""
        tools = Functions.of(
            arguments.get("tools"),
            arguments.get("tool_choice"),
            arguments.get("parallel_tool_calls"),
        )
        return None if tools is None else cls(tools, family)

    @property
    def constraint(self) -> StructuredOutputs | None:
        return None if self.family is None else self.family.constraint(self.tools)

    @property
    def parsed(self) -> bool:
        """The reply is parsed here, so special tokens (call markers) are kept in it."""
        return self.family is not None and self.tools.parsed

    def result(self, done: Completion) -> dict[str, Any]:
        """``tool_calls`` (and the finish reason they imply) for the finished reply."""
        if not self.tools.parsed:
            return {}
        if done.tool_calls is not None:  # the backend read them (fleet mode)
            calls = done.tool_calls
        else:
            assert self.family is not None
            calls = parser.parse(self.family, done.text).calls
            calls = calls if self.tools.parallel else calls[:1]
        out: dict[str, Any] = {
            "tool_calls": [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": _arguments(c.arguments)},
                }
                for c in calls
            ]
        }
        out["finish_reason"] = parser.finish_reason(done.finish_reason, bool(calls))
        return out


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text
