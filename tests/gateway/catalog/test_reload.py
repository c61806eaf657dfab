"""Runtime catalog changes in one process: reload, listen streams told after the swap, peers'
announcements followed by re-reading the config, a bad config refused, drain ends streams.
(Across processes through Redis: tests/gateway/test_redis_cache.py.)"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.gateway.live_server import LiveServer
from tests.gateway.wire import call, modern_headers, modern_meta

LISTEN = {
    "jsonrpc": "2.0",
    "id": "w",
    "method": "subscriptions/listen",
    "params": {
        "notifications": {"toolsListChanged": True, "resourcesListChanged": True},
        "_meta": modern_meta(),
    },
}
KINDS = ["notifications/resources/list_changed", "notifications/tools/list_changed"]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "catalog.json"
    path.write_text(json.dumps({"instructions": "One."}))
    return path


@pytest.fixture
def live(engine: Any, config: Path) -> Iterator[LiveServer]:
    with LiveServer(engine, catalog_config=str(config), keepalive_s=0.1) as server:
        yield server


def messages(response: httpx.Response) -> Iterator[dict[str, Any] | None]:
    """JSON-RPC messages of an SSE stream; None for each keep-alive comment."""
    for line in response.iter_lines():
        if line.startswith(":"):
            yield None
        elif line.startswith("data:"):
            yield orjson.loads(line[5:])


def next_messages(
    stream: Iterator[dict[str, Any] | None], count: int, keepalives: int = 20
) -> list:
    found: list[dict[str, Any]] = []
    for message in stream:
        if message is not None:
            found.append(message)
        else:
            keepalives -= 1
        if len(found) == count or keepalives == 0:
            break
    return found


def write(path: Path, config: dict[str, Any]) -> None:
    path.write_text(json.dumps(config))


def test_reload_swaps_then_tells_listeners(live: LiveServer, config: Path) -> None:
    reloader = live.app.state.catalog_reloader
    resource = {"uri": "docs://usage", "name": "usage", "text": "Call generate."}
    with (
        httpx.Client(timeout=10) as http,
        http.stream(
            "POST",
            live.url,
            content=orjson.dumps(LISTEN),
            headers=modern_headers("subscriptions/listen"),
        ) as response,
    ):
        stream = messages(response)
        assert next_messages(stream, 1)[0]["method"] == "notifications/subscriptions/acknowledged"
        write(config, {"instructions": "Two.", "resources": [resource]})
        before = live.app.state.served.current.version
        result = live.run(reloader.reload("test"))
        changes = next_messages(stream, 2)
        listed = call(http, live.url, "resources/list").result["resources"]
        read = call(http, live.url, "resources/read", {"uri": "docs://usage"}, name="docs://usage")
        again = live.run(reloader.reload("test"))
        assert next_messages(stream, 1, keepalives=3) == []  # nothing changed, nothing said
    assert (result.previous, result.changed) == (before, True)
    assert result.version == live.app.state.served.current.version
    assert sorted(m["method"] for m in changes) == KINDS
    assert all(
        m["params"]["_meta"]["io.modelcontextprotocol/subscriptionId"] == "w" for m in changes
    )
    assert [r["uri"] for r in listed][1:] == ["docs://usage"]
    assert read.result["contents"][0]["text"] == "Call generate."
    assert not again.changed


def test_a_peer_announcement_rereads_the_config(live: LiveServer, config: Path) -> None:
    """Another process published a version this one cannot build from the hash: it re-reads
    its config; a config that did not change keeps the catalog (and says nothing)."""
    served, cache = live.app.state.served, live.app.state.discovery_cache
    live.app.state.catalog_reloader.reread_delays_s = ()  # one re-read per announcement
    before = served.current.version
    live.run(cache.publish_version("peer-unchanged"))
    with httpx.Client(timeout=10) as http:
        assert call(http, live.url, "server/discover").result["instructions"] == "One."
        write(config, {"instructions": "From the peer."})
        live.run(cache.publish_version("peer-changed"))
        deadline = time.monotonic() + 3  # the re-read runs on the server's loop, not in publish
        while served.current.version == before:
            assert time.monotonic() < deadline, "the peer's announcement was never acted on"
            time.sleep(0.02)
        discovered = call(http, live.url, "server/discover").result
        metrics = http.get(live.base + "/metrics").text
    assert served.current.version != before
    assert discovered["instructions"] == "From the peer."
    assert 'kvgate_catalog_reloads_total{outcome="unchanged",trigger="peer"} 1.0' in metrics
    assert 'kvgate_catalog_reloads_total{outcome="changed",trigger="peer"} 1.0' in metrics


def test_a_config_that_arrives_late_is_picked_up(
    live: LiveServer, config: Path, tmp_path: Path
) -> None:
    """A peer announced the catalog of a file this process does not see yet: it re-reads on a
    schedule until its config yields that version, then stops."""
    from dataclasses import replace

    from kvgate.gateway.app import build_catalog

    reloader, served = live.app.state.catalog_reloader, live.app.state.served
    reloader.reread_delays_s = (0.1,) * 50
    future = tmp_path / "future.json"
    write(future, {"instructions": "Arrives late."})
    wanted = build_catalog(served.current.facts, replace(live.settings, catalog_config=str(future)))
    live.run(live.app.state.discovery_cache.publish_version(wanted.version))
    time.sleep(0.35)
    assert served.current.version != wanted.version  # still the old file: still the old catalog
    config.write_bytes(future.read_bytes())
    deadline = time.monotonic() + 3
    while served.current.version != wanted.version:
        assert time.monotonic() < deadline, "the late config was never picked up"
        time.sleep(0.02)
    with httpx.Client(timeout=10) as http:
        rereads = reloads(http, live)
        time.sleep(0.35)
        assert reloads(http, live) == rereads  # caught up: no more re-reads
        assert call(http, live.url, "server/discover").result["instructions"] == "Arrives late."


def reloads(http: httpx.Client, live: LiveServer) -> float:
    lines = http.get(live.base + "/metrics").text.splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("kvgate_catalog_reloads_total{")
    )


def test_a_bad_config_keeps_the_catalog(live: LiveServer, config: Path) -> None:
    from kvgate.gateway.catalog.config import CatalogConfigError

    served = live.app.state.served.current.version
    config.write_text('{"instructions": ')
    with pytest.raises(CatalogConfigError, match="catalog.json"):
        live.run(live.app.state.catalog_reloader.reload("test"))
    assert live.app.state.served.current.version == served


def test_drain_flips_readiness_and_ends_listen_streams(engine: Any) -> None:
    with LiveServer(engine, keepalive_s=0.1) as live, httpx.Client(timeout=10) as http:
        assert http.get(live.base + "/readyz").status_code == 200
        with http.stream(
            "POST",
            live.url,
            content=orjson.dumps(LISTEN),
            headers=modern_headers("subscriptions/listen"),
        ) as response:
            stream = messages(response)
            next_messages(stream, 1)
            live.app.state.begin_drain()
            rest = [m for m in stream if m is not None]  # ends: the server closed the stream
        ready = http.get(live.base + "/readyz")
        late = call(http, live.url, "subscriptions/listen", {"notifications": {}}).messages
    assert rest[-1]["id"] == "w" and rest[-1]["result"]["resultType"] == "complete"
    assert (ready.status_code, ready.json()) == (503, {"ready": False, "replicas": [True]})
    assert late[-1]["result"]["resultType"] == "complete"  # a listen during drain ends at once
