"""Operator endpoints, behind a bearer API key; absent (404) when no key is configured.

``POST /admin/catalog/reload`` re-reads the catalog config in this process, serves the result
and, if it changed, publishes its version so every process sharing the Redis follows.
"""

from __future__ import annotations

import hmac

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.catalog.config import CatalogConfigError
from gateway.catalog.reload import CatalogReloader


def admin_routes(api_key: str | None, reloader: CatalogReloader) -> list[Route]:
    if not api_key:
        return []
    expected = api_key.encode()

    async def reload_catalog(request: Request) -> Response:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        # RFC 9110 11.1: the scheme is case-insensitive ("bearer" is "Bearer")
        valid = scheme.lower() == "bearer" and hmac.compare_digest(
            given.strip(" ").encode(), expected
        )
        if not valid:  # constant time: no key guessing by timing
            return JSONResponse(
                {"error": "a valid admin API key is required"},
                status_code=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        try:
            result = await reloader.reload("admin")
        except CatalogConfigError as exc:
            return JSONResponse({"error": str(exc)}, status_code=422)
        return JSONResponse(
            {"previous": result.previous, "version": result.version, "changed": result.changed}
        )

    return [Route("/admin/catalog/reload", reload_catalog, methods=["POST"])]
