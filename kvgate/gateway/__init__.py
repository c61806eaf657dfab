"""The kvgate gateway: front doors (``mcp/``), HTTP plumbing (``http/``), what is offered and
how it is shared (``catalog/``), operations (``ops/``), and the generation requests every front
door starts (``generation``), composed by ``app.create_app``."""

from kvgate.gateway.app import create_app
from kvgate.gateway.settings import Settings

__all__ = ["Settings", "create_app"]
