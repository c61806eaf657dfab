"""Tool argument validation with a real JSON Schema 2020-12 validator.

Failures become messages a model can act on: which argument, what is wrong, what is allowed.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError

MAX_PROBLEMS = 20
MAX_MESSAGE_CHARS = 300


class ArgumentValidator:
    """Checks one tool's arguments against its ``inputSchema`` (checked itself at startup)."""

    def __init__(self, tool_name: str, input_schema: Mapping[str, Any]) -> None:
        Draft202012Validator.check_schema(input_schema)
        self.tool_name = tool_name
        self._validator = Draft202012Validator(input_schema)
        self._integers = frozenset(
            name
            for name, sub in (input_schema.get("properties") or {}).items()
            if isinstance(sub, Mapping) and sub.get("type") == "integer"
        )

    def problems(self, arguments: Any) -> list[str]:
        """One sentence per problem (the first ``MAX_PROBLEMS``), empty when the arguments
        are valid: a body of a thousand bad items costs no more than one of a few."""
        found = itertools.islice(self._validator.iter_errors(arguments), MAX_PROBLEMS)
        return [_describe(error) for error in sorted(found, key=lambda e: list(e.path))]

    def with_integers(self, arguments: Mapping[str, Any]) -> Mapping[str, Any]:
        """Valid ``arguments`` with each integral float given to an ``integer`` property
        made an int: JSON Schema 2020-12 calls ``8.0`` an integer, Python code does not."""
        fixed = {
            key: int(value)
            for key, value in arguments.items()
            if key in self._integers and isinstance(value, float) and value.is_integer()
        }
        return {**arguments, **fixed} if fixed else arguments


def _describe(error: ValidationError) -> str:
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    where = where.lstrip(".") or "arguments"
    hint = error.schema.get("description") if isinstance(error.schema, dict) else None
    message = error.message  # it quotes the instance: a 1 MiB value stays out of the reply
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 1] + "…"
    sentence = f"{where}: {message}"
    if hint and error.validator not in ("required", "additionalProperties"):
        sentence += f" ({hint})"
    return sentence
