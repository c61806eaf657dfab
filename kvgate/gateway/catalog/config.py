"""Operator catalog content: instructions, static text resources and prompt templates.

Read from a JSON file (``--catalog-config``) at start, on SIGHUP and on
``POST /admin/catalog/reload``; the catalog version hashes what it yields, so processes that
read the same file serve the same version. A bad file is refused as a whole with one message
naming the problem, and the catalog being served stays as it was.

    {"instructions": "...",
     "resources": [{"uri": "docs://usage", "name": "usage", "text": "...",
                    "mimeType": "text/markdown", "title": "...", "description": "..."}],
     "prompts": [{"name": "translate", "description": "...", "template": "Translate: $text",
                  "arguments": [{"name": "text", "required": true}]}]}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

import jsonschema
import orjson

from kvgate.protocol.errors import invalid_params

_TEXT = {"type": "string"}
SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "instructions": _TEXT,
        "resources": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["uri", "name", "text"],
                "additionalProperties": False,
                "properties": {
                    "uri": {"type": "string", "pattern": "^[a-zA-Z][a-zA-Z0-9+.-]*:"},
                    "name": _TEXT,
                    "text": _TEXT,
                    "mimeType": _TEXT,
                    "title": _TEXT,
                    "description": _TEXT,
                },
            },
        },
        "prompts": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "template"],
                "additionalProperties": False,
                "properties": {
                    "name": _TEXT,
                    "template": _TEXT,
                    "title": _TEXT,
                    "description": _TEXT,
                    "arguments": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["name"],
                            "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string", "pattern": "^[_a-zA-Z][_a-zA-Z0-9]*$"},
                                "description": _TEXT,
                                "required": {"type": "boolean"},
                            },
                        },
                    },
                },
            },
        },
    },
}


class CatalogConfigError(ValueError):
    """The catalog config file cannot be read or is not valid; the message says why."""


@dataclass(frozen=True)
class StaticResource:
    listing: dict[str, Any]  # the resources/list entry
    text: str

    @property
    def uri(self) -> str:
        return str(self.listing["uri"])

    def contents(self) -> dict[str, Any]:
        """The resources/read result body."""
        mime = self.listing.get("mimeType", "text/plain")
        return {"contents": [{"uri": self.uri, "mimeType": mime, "text": self.text}]}


@dataclass(frozen=True)
class PromptTemplate:
    listing: dict[str, Any]  # the prompts/list entry
    template: str  # ``$argument`` placeholders, checked against the declared arguments

    @property
    def name(self) -> str:
        return str(self.listing["name"])

    def render(self, arguments: Any) -> dict[str, Any]:
        """The prompts/get result body; a missing required argument is -32602."""
        given = arguments if isinstance(arguments, dict) else {}
        values = {}
        for argument in self.listing.get("arguments", []):
            value = given.get(argument["name"])
            if not isinstance(value, str) and argument.get("required"):
                raise invalid_params(
                    f"Prompt '{self.name}' needs the string argument '{argument['name']}'"
                )
            values[argument["name"]] = value if isinstance(value, str) else ""
        text = Template(self.template).substitute(values)
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": {"type": "text", "text": text}}]
        }
        if "description" in self.listing:
            body["description"] = self.listing["description"]
        return body


@dataclass(frozen=True)
class CatalogConfig:
    instructions: str | None = None  # None: the server's default instructions
    resources: tuple[StaticResource, ...] = ()
    prompts: tuple[PromptTemplate, ...] = ()

    def fingerprint(self) -> list[Any]:
        """Everything here that shapes a result, for the catalog's content hash."""
        return [
            self.instructions,
            [(r.listing, r.text) for r in self.resources],
            [(p.listing, p.template) for p in self.prompts],
        ]


def load_catalog_config(path: str | Path) -> CatalogConfig:
    try:
        raw = orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError) as exc:
        raise CatalogConfigError(f"catalog config {path}: {exc}") from exc
    return parse_catalog_config(raw, str(path))


def parse_catalog_config(raw: Any, source: str = "catalog config") -> CatalogConfig:
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(SCHEMA).iter_errors(raw)
    )
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(top)"
        raise CatalogConfigError(f"{source}: {where}: {error.message}")
    resources = tuple(
        StaticResource({k: v for k, v in item.items() if k != "text"}, item["text"])
        for item in raw.get("resources", [])
    )
    prompts = tuple(_prompt(item, source) for item in raw.get("prompts", []))
    for kind, names in (
        ("resource uri", [r.uri for r in resources]),
        ("prompt name", [p.name for p in prompts]),
    ):
        if len(set(names)) != len(names):
            raise CatalogConfigError(f"{source}: a {kind} appears twice")
    return CatalogConfig(raw.get("instructions"), resources, prompts)


def _prompt(item: dict[str, Any], source: str) -> PromptTemplate:
    template = Template(item["template"])
    declared = {argument["name"] for argument in item.get("arguments", [])}
    if not template.is_valid():
        raise CatalogConfigError(f"{source}: prompt '{item['name']}': bad $placeholder")
    unknown = set(template.get_identifiers()) - declared
    if unknown:
        raise CatalogConfigError(
            f"{source}: prompt '{item['name']}' uses undeclared argument(s) {sorted(unknown)}"
        )
    return PromptTemplate({k: v for k, v in item.items() if k != "template"}, item["template"])
