"""The kvgate gateway: front doors (``mcp/``), HTTP plumbing (``http/``), what is offered and
how it is shared (``catalog/``), operations (``ops/``), and the generation requests every front
door starts (``generation``), composed by ``app.create_app``."""

import importlib.metadata as _metadata

from gateway.app import create_app
from gateway.settings import Settings

try:  # the installed distribution's version (pyproject.toml), one source for --version too
    __version__ = _metadata.version("kvgate")
except _metadata.PackageNotFoundError:  # a source tree on sys.path without an install
    __version__ = "0+unknown"

__all__ = ["Settings", "create_app"]
