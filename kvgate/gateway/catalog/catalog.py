"""The catalog: what this server offers, derived from the loaded model and the settings.

Everything here is the same for every caller, so each result is shaped and serialized once,
when the catalog is built, and named by a content hash (the catalog *version*). Requests
splice the stored bytes into their response; nothing is re-encoded per request.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import orjson

from kvgate.gateway.catalog.config import CatalogConfig, CatalogConfigError, PromptTemplate
from kvgate.protocol.errors import invalid_params
from kvgate.protocol.headers import HeaderParam, header_params
from kvgate.protocol.results import cacheable
from kvgate.protocol.tasks import TASKS_EXTENSION
from kvgate.protocol.versions import SUPPORTED_VERSIONS
from kvgate.schemas.tools import inference_tools
from kvgate.schemas.validation import ArgumentValidator

MODEL_URI_PREFIX = "kvgate://models/"


def server_info(name: str) -> dict[str, str]:
    try:
        version = metadata.version("kvgate")
    except metadata.PackageNotFoundError:
        version = "0.0.0"
    return {"name": name, "version": version}


@dataclass(frozen=True)
class ModelFacts:
    """What the catalog says about the served model (static for the process's life)."""

    name: str
    max_model_len: int
    block_size: int
    num_blocks: int
    kv_cache_dtype: str
    replicas: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.name,
            "max_model_len": self.max_model_len,
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "kv_cache_dtype": self.kv_cache_dtype,
            "replicas": self.replicas,
        }


@dataclass(frozen=True)
class ToolSpec:
    """How to check a call of one tool: its argument schema and its ``Mcp-Param-*`` headers."""

    name: str
    validator: ArgumentValidator
    header_params: tuple[HeaderParam, ...]

    @classmethod
    def of(cls, definition: dict[str, Any]) -> ToolSpec:
        schema = definition["inputSchema"]
        name = definition["name"]
        return cls(name, ArgumentValidator(name, schema), header_params(schema))


SUMMARIZE_PROMPT = {
    "name": "summarize",
    "title": "Summarize",
    "description": "A user message asking the model to summarize a text in a few sentences.",
    "arguments": [{"name": "text", "description": "The text to summarize.", "required": True}],
}


@dataclass
class Catalog:
    """Tools, resources, prompts and discovery for one model, with their serialized results."""

    facts: ModelFacts
    server_name: str = "kvgate"
    instructions: str = ""
    ttl_ms: int = 3_600_000
    config: CatalogConfig = field(default_factory=CatalogConfig)  # operator resources, prompts
    server_info: dict[str, str] = field(init=False)
    tools: list[dict[str, Any]] = field(init=False)
    tool_specs: dict[str, ToolSpec] = field(init=False)
    version: str = field(init=False)
    _bytes: dict[str, bytes] = field(init=False)
    _resources: dict[str, bytes] = field(init=False)
    _prompts: dict[str, PromptTemplate] = field(init=False)

    def __post_init__(self) -> None:
        self.server_info = server_info(self.server_name)
        self.tools = inference_tools(self.facts.name, self.facts.max_model_len)
        self.tool_specs = {d["name"]: ToolSpec.of(d) for d in self.tools}
        uri = MODEL_URI_PREFIX + self.facts.name
        resource = {
            "uri": uri,
            "name": self.facts.name,
            "title": f"Model {self.facts.name}",
            "description": "The served model: context length and KV cache layout.",
            "mimeType": "application/json",
        }
        contents = {
            "contents": [
                {
                    "uri": uri,
                    "mimeType": "application/json",
                    "text": orjson.dumps(self.facts.as_dict()).decode(),
                }
            ]
        }
        template = {
            "uriTemplate": MODEL_URI_PREFIX + "{model}",
            "name": "model",
            "title": "Served model",
            "description": "Facts about a served model, by name.",
            "mimeType": "application/json",
        }
        capabilities = {
            "tools": {"listChanged": True},
            "resources": {"listChanged": True},
            "prompts": {"listChanged": True},
            "extensions": {TASKS_EXTENSION: {}},  # kvgate.gateway.tasks: long generations as tasks
        }
        results: dict[str, dict[str, Any]] = {
            "server/discover": {
                "supportedVersions": list(SUPPORTED_VERSIONS),
                "capabilities": capabilities,
                "instructions": self.instructions,
            },
            "tools/list": {"tools": self.tools},
            "resources/list": {
                "resources": [resource, *(r.listing for r in self.config.resources)]
            },
            "resources/templates/list": {"resourceTemplates": [template]},
            "prompts/list": {
                "prompts": [SUMMARIZE_PROMPT, *(p.listing for p in self.config.prompts)]
            },
        }
        self.version = hashlib.sha256(
            orjson.dumps(
                [results, contents, self.server_info, self.config.fingerprint()],
                option=orjson.OPT_SORT_KEYS,
            )
        ).hexdigest()[:16]
        self._bytes = {method: self._serialize(result) for method, result in results.items()}
        self._resources = {uri: self._serialize(contents)}
        self._prompts = {p.name: p for p in self.config.prompts}
        for extra in self.config.resources:
            if extra.uri in self._resources:
                raise CatalogConfigError(f"resource {extra.uri} is already served")
            self._resources[extra.uri] = self._serialize(extra.contents())
        if SUMMARIZE_PROMPT["name"] in self._prompts:
            raise CatalogConfigError(f"prompt {SUMMARIZE_PROMPT['name']} is already served")

    def _serialize(self, result: dict[str, Any]) -> bytes:
        return orjson.dumps(cacheable(result, self.server_info, self.ttl_ms, "public"))

    def result_bytes(self, method: str, params: dict[str, Any]) -> bytes:
        """The serialized result of a catalog method; unknown resources are -32602."""
        if method == "resources/read":
            uri = params.get("uri")
            body = self._resources.get(uri) if isinstance(uri, str) else None
            if body is None:
                raise invalid_params(f"Resource not found: {uri}", data={"uri": uri})
            return body
        return self._bytes[method]

    def tool_spec(self, name: Any) -> ToolSpec:
        """The tool called ``name``; an unknown tool is a protocol error (-32602)."""
        spec = self.tool_specs.get(name) if isinstance(name, str) else None
        if spec is None:
            raise invalid_params(f"Unknown tool: {name}", data={"name": name})
        return spec

    def legacy_capabilities(self) -> dict[str, Any]:
        """Handshake-era wires have no listen stream, so nothing announces list changes."""
        return {"tools": {}, "resources": {}, "prompts": {}}

    def get_prompt(self, name: Any, arguments: Any) -> dict[str, Any]:
        """The ``prompts/get`` result body (unshaped)."""
        if isinstance(name, str) and name in self._prompts:
            return self._prompts[name].render(arguments)
        if name != SUMMARIZE_PROMPT["name"]:
            raise invalid_params(f"Unknown prompt: {name}", data={"name": name})
        text = arguments.get("text") if isinstance(arguments, dict) else None
        if not isinstance(text, str):
            raise invalid_params("Prompt 'summarize' needs the string argument 'text'")
        message = f"Summarize the following text in a few sentences.\n\n{text}"
        return {
            "description": SUMMARIZE_PROMPT["description"],
            "messages": [{"role": "user", "content": {"type": "text", "text": message}}],
        }


class CatalogHolder:
    """The one owner of the catalog being served: request handlers read ``current`` (one
    attribute read: a request sees one whole catalog), the reloader ``swap``s it."""

    def __init__(self, catalog: Catalog) -> None:
        self.current = catalog

    def swap(self, catalog: Catalog) -> Catalog:
        """Serve ``catalog`` from the next request on; returns the one it replaces."""
        previous, self.current = self.current, catalog
        return previous
