"""The console's pages are served from the package with a policy that keeps them to this
server, need no credential when keys are on (the data routes still do), and are gone with
``--no-ui``."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from kvgate.gateway.console.routes import STATIC
from tests.gateway.live_server import LiveServer


@pytest.fixture(scope="module")
def keyed(engine) -> Iterator[LiveServer]:
    with LiveServer(engine, api_key="console-key") as live:
        yield live


def test_every_file_is_served_with_its_type_and_policy(server: LiveServer) -> None:
    names = sorted(p.name for p in STATIC.iterdir())
    assert {"index.html", "app.js", "style.css"} <= set(names)
    for name in names:
        answer = httpx.get(f"{server.base}/ui/{name}")
        assert answer.status_code == 200 and answer.content == (STATIC / name).read_bytes()
        kind = {"html": "text/html", "js": "text/javascript", "css": "text/css"}
        assert answer.headers["content-type"].startswith(kind[name.rpartition(".")[2]])
        assert "default-src 'self'" in answer.headers["content-security-policy"]
    for page in ("/", "/ui"):
        assert httpx.get(server.base + page).content == (STATIC / "index.html").read_bytes()
    assert httpx.get(server.base + "/ui/nothing.js").status_code == 404


def test_the_pages_need_no_key_and_the_data_does(keyed: LiveServer) -> None:
    assert httpx.get(keyed.base + "/").status_code == 200
    assert httpx.get(keyed.base + "/ui/api.js").status_code == 200
    assert httpx.get(keyed.base + "/v1/models").status_code == 401
    key = {"Authorization": "Bearer console-key"}
    assert httpx.get(keyed.base + "/v1/models", headers=key).status_code == 200


def test_no_ui_serves_neither_path(engine) -> None:
    with LiveServer(engine, ui=False) as live:
        for path in ("/", "/ui", "/ui/app.js"):
            assert httpx.get(live.base + path).status_code == 404
