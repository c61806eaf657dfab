"""Operator endpoints; absent (404) when no admin credential is configured. The auth
middleware (``kvgate.gateway.auth``) admits only the admin key or a token with the admin scope.

``POST /admin/catalog/reload`` re-reads the catalog config in this process, serves the result
and, if it changed, publishes its version so every process sharing the Redis follows.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kvgate.gateway.catalog.config import CatalogConfigError
from kvgate.gateway.catalog.reload import CatalogReloader


def admin_routes(enabled: bool, reloader: CatalogReloader) -> list[Route]:
    if not enabled:
        return []

    async def reload_catalog(request: Request) -> Response:
        try:
            result = await reloader.reload("admin")
        except CatalogConfigError as exc:
            return JSONResponse({"error": str(exc)}, status_code=422)
        return JSONResponse(
            {"previous": result.previous, "version": result.version, "changed": result.changed}
        )

    return [Route("/admin/catalog/reload", reload_catalog, methods=["POST"])]
