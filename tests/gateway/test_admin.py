"""The admin endpoint: absent without a key, refused with a wrong one, a reload with the right one."""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.gateway.live_server import LiveServer

RELOAD = "/admin/catalog/reload"


def test_no_key_configured_means_no_admin_endpoint(server: LiveServer) -> None:
    assert (
        httpx.post(server.base + RELOAD, headers={"Authorization": "Bearer x"}).status_code == 404
    )


def test_reload_needs_the_key_and_reports_versions(engine: Any, tmp_path) -> None:
    config = tmp_path / "catalog.json"
    config.write_text(json.dumps({"instructions": "One."}))
    with LiveServer(engine, catalog_config=str(config), admin_api_key="s3cret") as live:
        url = live.base + RELOAD
        served = live.app.state.served.current.version
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            refused = httpx.post(url, headers=headers)
            assert refused.status_code == 401
            assert refused.headers["www-authenticate"].startswith("Bearer")
        assert httpx.get(url, headers={"Authorization": "Bearer s3cret"}).status_code == 405
        auth = {"Authorization": "Bearer s3cret"}
        unchanged = httpx.post(url, headers=auth).json()
        config.write_text(json.dumps({"instructions": "Two."}))
        changed = httpx.post(url, headers=auth).json()
        config.write_text(json.dumps({"instructions": ["not", "text"]}))
        bad = httpx.post(url, headers=auth)
        metrics = httpx.get(live.base + "/metrics").text
    assert unchanged == {"previous": served, "version": served, "changed": False}
    assert changed["previous"] == served and changed["changed"] and changed["version"] != served
    assert bad.status_code == 422 and "instructions" in bad.json()["error"]
    assert 'kvgate_catalog_reloads_total{outcome="error",trigger="admin"} 1.0' in metrics
