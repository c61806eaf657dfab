"""JSON Schemas: the inference tools' input and output schemas, the validator that explains
what to change, and the MCP specification's own ``schema.json`` per wire revision."""

from kvgate.schemas.tools import inference_tools
from kvgate.schemas.validation import ArgumentValidator

__all__ = ["ArgumentValidator", "inference_tools"]
