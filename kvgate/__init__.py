"""kvgate: a stateless, MCP-native LLM inference gateway with an embedded paged-KV engine.

Its import packages, one idea each: ``kvgate.engine`` (inference, no HTTP or MCP),
``kvgate.protocol`` (MCP and JSON-RPC, pure), ``kvgate.schemas`` (the tools' JSON Schemas) and
``kvgate.gateway`` (the HTTP doors that wire them). Importing ``kvgate`` imports none of them.
"""

import importlib.metadata as _metadata

try:  # the installed distribution's version (pyproject.toml), one source for --version too
    __version__ = _metadata.version("kvgate")
except _metadata.PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"
