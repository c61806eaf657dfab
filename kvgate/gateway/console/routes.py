"""The web console at ``/`` and ``/ui``: a chat playground, the catalog, live charts and the
fleet's upstreams, in plain HTML, CSS and ES modules shipped in the package (``static/``).

Nothing is built and nothing comes from elsewhere: the Content-Security-Policy lets the page
load only this server's files and talk only to it, so the console works offline and a
stray external reference fails loudly in a browser. The pages carry no data: every figure is
fetched by the browser from the API (``/v1/models``, ``/mcp``, ``/metrics``, ``/readyz``)
with the API key typed into the page, so the pages themselves need none.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

STATIC = Path(__file__).parent / "static"
PAGE = "index.html"
ASSET_PREFIX = "/ui/"
PAGE_PATHS = ("/", "/ui")
TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
}
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",  # a new kvgate's console, not the old one's, after an upgrade
}


def is_console(path: str) -> bool:
    """Whether ``path`` is one of the console's pages or files (they need no credential)."""
    return path in PAGE_PATHS or path.startswith(ASSET_PREFIX)


def console_routes() -> list[Route]:
    """The page at ``/`` and ``/ui``, its files under ``/ui/``; read once, here."""
    files = {p.name: (p.read_bytes(), TYPES[p.suffix]) for p in STATIC.iterdir()}

    def answer(name: str) -> Response:
        found = files.get(name)
        if found is None:
            return PlainTextResponse("Not Found", status_code=404)
        body, media_type = found
        return Response(body, media_type=media_type, headers=HEADERS)

    async def page(request: Request) -> Response:
        return answer(PAGE)

    async def asset(request: Request) -> Response:
        return answer(request.path_params["name"])

    return [
        *(Route(path, page, methods=["GET"]) for path in PAGE_PATHS),
        Route(ASSET_PREFIX + "{name}", asset, methods=["GET"]),
    ]
