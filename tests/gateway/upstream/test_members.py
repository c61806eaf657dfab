"""``--upstream-dns``: a name resolving to several upstreams, re-resolved as pods come and go.

The upstreams are real kvgate processes on 127.0.0.1, .2 and .3, one port (as a headless
Service's pods are); the name's answers come from a resolver the test controls, like the
records a Kubernetes DNS server would serve. ``localhost`` goes through the system resolver.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate.gateway.settings import SettingError, Settings
from kvgate.gateway.upstream.fleet import Fleet, FleetConfigError
from kvgate.gateway.upstream.members import DnsTarget
from tests.gateway.live_server import LiveServer, free_port
from tests.gateway.upstream.processes import FLEET_FLAGS, Process, generate, running

HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")


@pytest.fixture(scope="module")
def pods(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Process]]:
    log_dir, port = tmp_path_factory.mktemp("dns"), free_port()
    with running([Process(log_dir, host=host, port=port) for host in HOSTS]) as started:
        yield started


def test_dns_targets_are_validated() -> None:
    assert DnsTarget.parse("vllm.default.svc:8000") == DnsTarget("http", "vllm.default.svc", 8000)
    assert DnsTarget.parse("https://vllm:443") == DnsTarget("https", "vllm", 443)
    for bad in ("vllm", "vllm:0", "vllm:99999", "vllm:http", "ftp://vllm:1", "vllm:80/v1", ":80"):
        with pytest.raises(ValueError, match="--upstream-dns"):
            DnsTarget.parse(bad)
    with pytest.raises(FleetConfigError, match="--upstream-dns"):
        Fleet.connect(Settings(upstream_dns=("no-port",)))
    with pytest.raises(SettingError, match="--upstream-refresh"):
        Settings(upstream_dns=("localhost:1",), upstream_refresh_s=0)


def test_addresses_join_and_leave_the_ring_as_the_name_resolves(pods: list[Process]) -> None:
    port = pods[0].port
    answer = list(HOSTS[:2])
    settings = Settings(
        upstream_dns=(f"pods.test:{port}",),
        upstream_refresh_s=0.2,
        upstream_health_interval_s=0,
        upstream_scrape_interval_s=0,
    )

    def resolve(host: str, asked: int) -> list[str]:
        assert (host, asked) == ("pods.test", port)
        if not answer:
            raise OSError("NXDOMAIN")
        return list(reversed(answer))  # any order: members are sorted

    fleet = Fleet.connect(settings, resolve)
    with LiveServer(None, backend=fleet) as gateway:

        def members() -> list[str]:
            return [
                u["url"] for u in httpx.get(gateway.base + "/readyz", timeout=5).json()["upstreams"]
            ]

        def wait_members(expected: list[str]) -> None:
            deadline = time.monotonic() + 5
            while members() != expected:
                assert time.monotonic() < deadline, (members(), expected)
                time.sleep(0.05)

        keys = [f"user-{i}" for i in range(24)]

        def owners() -> dict[str, str]:
            return {
                k: generate(gateway.base, cache_key=k, prompt="hi")["structuredContent"]["upstream"]
                for k in keys
            }

        wait_members([pods[0].base, pods[1].base])
        before = owners()
        assert set(before.values()) == {pods[0].base, pods[1].base}
        answer.append(HOSTS[2])  # a pod became ready
        wait_members([p.base for p in pods])
        joined = owners()
        moved = {k for k in keys if joined[k] != before[k]}
        assert moved and all(joined[k] == pods[2].base for k in moved)  # only onto the new one
        results = [generate(gateway.base, cache_key=k, prompt="hi") for k in moved]
        assert {r["structuredContent"]["replica"] for r in results} == {2}  # the next index
        answer.clear()  # the name stops resolving: the members stay
        time.sleep(0.5)
        assert members() == [p.base for p in pods]
        answer.extend(HOSTS[1:])  # the first pod went away
        wait_members([pods[1].base, pods[2].base])
        left = owners()
        assert all(left[k] == joined[k] for k in keys if joined[k] != pods[0].base)
        assert pods[0].base not in left.values()
        metrics = httpx.get(gateway.base + "/metrics", timeout=5).text
        assert 'event="joined"' in metrics and 'event="left"' in metrics
        assert "kvgate_upstream_dns_errors_total" in metrics


def test_localhost_resolves_through_the_system_resolver(
    pods: list[Process], tmp_path: Path
) -> None:
    """A gateway process given ``--upstream-dns localhost:PORT`` serves from the pod there."""
    gateway = Process(
        tmp_path, "--upstream-dns", f"localhost:{pods[0].port}", *FLEET_FLAGS, model=None
    ).start()
    try:
        gateway.wait_ready(60)
        urls = [u["url"] for u in gateway.readyz()["upstreams"]]
        assert pods[0].base in urls
        result = generate(gateway.base, prompt="hi")["structuredContent"]
        assert result["upstream"] == pods[0].base
    finally:
        gateway.stop()
