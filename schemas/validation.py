"""Tool argument validation with a real JSON Schema 2020-12 validator.

Failures become messages a model can act on: which argument, what is wrong, what is allowed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError


class ArgumentValidator:
    """Checks one tool's arguments against its ``inputSchema`` (checked itself at startup)."""

    def __init__(self, tool_name: str, input_schema: Mapping[str, Any]) -> None:
        Draft202012Validator.check_schema(input_schema)
        self.tool_name = tool_name
        self._validator = Draft202012Validator(input_schema)

    def problems(self, arguments: Any) -> list[str]:
        """One sentence per problem, empty when the arguments are valid."""
        errors = sorted(self._validator.iter_errors(arguments), key=lambda e: list(e.path))
        return [_describe(error) for error in errors]


def _describe(error: ValidationError) -> str:
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path)
    where = where.lstrip(".") or "arguments"
    hint = error.schema.get("description") if isinstance(error.schema, dict) else None
    sentence = f"{where}: {error.message}"
    if hint and error.validator not in ("required", "additionalProperties"):
        sentence += f" ({hint})"
    return sentence
