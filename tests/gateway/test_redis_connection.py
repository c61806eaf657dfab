"""Production Redis through the one factory, against real servers started here: TLS with a
private CA and an ACL user, Sentinel (a failover under load loses no call), a 3-master Cluster.
Budgets are the client under test (the discovery cache uses the same factory)."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import ipaddress
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvgate.engine import AsyncLLM
from kvgate.gateway.auth import budgets as budgets_module
from kvgate.gateway.auth.budgets import Budgets
from kvgate.gateway.calls.errors import Refused as Refusal
from kvgate.gateway.redis_connection import connect, stop_tasks
from tests.gateway.live_server import LiveServer, free_port
from tests.gateway.redis_fixtures import requires_redis_server
from tests.gateway.wire import call

REDIS_CLI = shutil.which("redis-cli")


class Server:
    """A redis-server (or sentinel) with arbitrary arguments on loopback.

    A port picked here is only free when picked: another process may take it before the
    server binds it (seen under a loaded CI), so a server that exits at once gets a new one.
    """

    def __init__(
        self,
        workdir: Path,
        *args: str,
        port: int | None = None,
        pick_port: Callable[[], int] = free_port,
        tls: bool = False,
    ):
        self.root, self.extra, self.tls = workdir, list(args), tls
        self.pick_port = None if port else pick_port
        self.use_port(port or pick_port())
        self.process: subprocess.Popen[bytes] | None = None

    def use_port(self, port: int) -> None:
        self.port = port
        self.workdir = self.root / str(port)
        self.workdir.mkdir(parents=True, exist_ok=True)
        port_args = ["--port", "0", "--tls-port", str(port)] if self.tls else ["--port", str(port)]
        self.args = [
            *self.extra,
            *port_args,
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--dir",
            str(self.workdir),
        ]

    def start(self) -> Server:
        assert shutil.which("redis-server")
        for _ in range(3):
            self.process = subprocess.Popen(
                ["redis-server", *self.args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.process.poll() is None:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.1).close()
                    return self
                except OSError:
                    time.sleep(0.02)
            exited = self.process.poll() is not None
            self.kill()
            if not (exited and self.pick_port):
                break
            self.use_port(self.pick_port())
        raise RuntimeError(f"redis-server {self.args} did not start")

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=5)
            self.process = None


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[Server]]:
    started: list[Server] = []
    yield started
    for server in started:
        server.kill()


async def test_stopping_listeners_ends_even_when_one_ignores_its_cancel(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """As a redis-py pub/sub close on a dead server did under load: the shutdown goes on."""

    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue

    polite = asyncio.create_task(asyncio.sleep(3600), name="polite")
    stuck = asyncio.create_task(stubborn(), name="stuck-listener")
    await asyncio.sleep(0)
    started = time.monotonic()
    await stop_tasks({polite, stuck}, wait_s=0.3)
    assert time.monotonic() - started < 2
    assert polite.cancelled() and not stuck.done()
    assert "stuck-listener did not stop" in caplog.text
    release.set()
    await stuck


def test_bad_urls_name_the_problem() -> None:
    for url, message in (
        ("localhost:6379", "no scheme"),
        ("http://localhost", "scheme 'http'"),
        ("redis+sentinel://h:1", "service"),
        ("redis+sentinel://h/svc", "host:port"),
    ):
        with pytest.raises(ValueError, match=message):
            connect(url)


async def admits(budgets: Budgets, tenant: str, n: int) -> int:
    ok = 0
    for _ in range(n):
        try:
            await budgets.admit(tenant)
            ok += 1
        except Refusal:
            pass
    return ok


def write_tls(tmp_path: Path) -> dict[str, Path]:
    """A private CA and a server certificate for 127.0.0.1 signed by it."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvgate test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(1)
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(2)
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    paths = {
        "ca": tmp_path / "ca.pem",
        "cert": tmp_path / "server.pem",
        "key": tmp_path / "server.key",
    }
    paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths["key"].write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    return paths


@requires_redis_server
async def test_tls_with_a_private_ca_and_an_acl_user(tmp_path: Path, servers: list[Server]) -> None:
    tls = write_tls(tmp_path)
    conf = tmp_path / "acl.conf"  # only an ACL user may connect, and only to kvgate keys
    conf.write_text("user default off\nuser gateway on >s3cret ~kvgate:* +@all\n")
    server = Server(
        tmp_path,
        str(conf),
        "--tls-cert-file", str(tls["cert"]),
        "--tls-key-file", str(tls["key"]),
        "--tls-ca-cert-file", str(tls["ca"]),
        "--tls-auth-clients", "no",
        tls=True,
    )  # fmt: skip
    servers.append(server.start())
    base = f"127.0.0.1:{server.port}/0?ssl_ca_certs={tls['ca']}"
    good = Budgets(2, 0, f"rediss://gateway:s3cret@{base}")
    wrong = Budgets(2, 0, f"rediss://gateway:nope@{base}")
    plain = Budgets(2, 0, f"redis://gateway:s3cret@{base.split('?')[0]}")
    try:
        assert await admits(good, "acme", 3) == 2 and not good.degraded  # shared, over TLS
        assert await admits(wrong, "acme", 1) == 1 and wrong.degraded  # refused: local fallback
        assert await admits(plain, "acme", 1) == 1 and plain.degraded  # no TLS: no connection
    finally:
        for budgets in (good, wrong, plain):
            await budgets.close()


def sentinel_pair(tmp_path: Path, servers: list[Server]) -> tuple[Server, Server, str]:
    """A master, its replica and two Sentinels watching them; returns the Sentinel URL."""
    master = Server(tmp_path).start()
    replica = Server(tmp_path, "--replicaof", "127.0.0.1", str(master.port)).start()
    servers += [master, replica]
    sentinel_ports = []
    for _ in range(2):
        port = free_port()
        conf = tmp_path / f"sentinel-{port}.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
            f"sentinel monitor kv 127.0.0.1 {master.port} 1\n"
            "sentinel down-after-milliseconds kv 300\n"
            "sentinel failover-timeout kv 2000\n"
        )
        sentinel = Server(tmp_path, str(conf), "--sentinel", port=port)
        sentinel.args = [str(conf), "--sentinel"]  # its port and dir come from the file
        servers.append(sentinel.start())
        sentinel_ports.append(port)
    hosts = ",".join(f"127.0.0.1:{p}" for p in sentinel_ports)
    return master, replica, f"redis+sentinel://{hosts}/kv"


async def is_master(server: Server) -> bool:
    client = connect(f"redis://127.0.0.1:{server.port}/0")
    try:
        return (await client.execute_command("ROLE"))[0] in (b"master", "master")
    finally:
        await client.aclose()


@requires_redis_server
async def test_sentinel_failover_under_load_loses_no_call(
    tmp_path: Path, servers: list[Server], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(budgets_module, "PROBE_EVERY_S", 0.1)
    master, replica, url = sentinel_pair(tmp_path, servers)
    budgets = Budgets(100_000, 0, url)
    try:
        assert await admits(budgets, "acme", 5) == 5 and not budgets.degraded
        await asyncio.sleep(0.5)  # the replica has synced
        master.kill()
        started, calls, failed = time.monotonic(), 0, 0
        while time.monotonic() - started < 15:
            try:
                await budgets.admit("acme")
            except Exception:  # noqa: BLE001 - any failure at all counts
                failed += 1
            calls += 1
            promoted = time.monotonic() - started > 1 and await is_master(replica)
            if promoted and not budgets.degraded:
                break
            await asyncio.sleep(0.01)
        assert failed == 0 and calls > 10
        assert promoted, "Sentinel did not promote the replica in 15 s"
        assert not budgets.degraded  # budgets are shared again, on the new master
    finally:
        await budgets.close()


@requires_redis_server
# A failover drops the gateway's Redis connections mid-call; redis-py leaves their sockets to
# the garbage collector, which reports them (ResourceWarning) whenever it runs.
@pytest.mark.filterwarnings("ignore::ResourceWarning")
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_gateway_on_sentinel_answers_every_request_through_a_failover(
    engine: AsyncLLM, tmp_path: Path, servers: list[Server]
) -> None:
    master, replica, url = sentinel_pair(tmp_path, servers)
    keys = tmp_path / "keys"
    keys.write_text(f"acme: {hashlib.sha256(b'acme-key').hexdigest()}\n")
    auth = {"Authorization": "Bearer acme-key"}
    settings = {"redis_url": url, "api_keys_file": str(keys), "budget_requests_per_min": 100_000}
    with LiveServer(engine, **settings) as live, httpx.Client(timeout=30) as http:
        body = {"prompt": "hi", "max_tokens": 1}
        assert http.post(live.base + "/v1/completions", json=body, headers=auth).status_code == 200
        assert call(http, live.url, "tools/list", headers=auth).status == 200
        assert not live.app.state.discovery_cache.degraded  # it reached Redis via Sentinel
        time.sleep(0.5)  # the replica has synced
        master.kill()
        started, statuses = time.monotonic(), []
        promoted = False
        while time.monotonic() - started < 15 and not promoted:
            statuses.append(
                http.post(live.base + "/v1/completions", json=body, headers=auth).status_code
            )
            statuses.append(call(http, live.url, "tools/list", headers=auth).status)
            promoted = time.monotonic() - started > 1 and asyncio.run(is_master(replica))
        deadline = time.monotonic() + 10
        while live.app.state.discovery_cache.degraded:  # the cache finds the new master too
            assert time.monotonic() < deadline, "the discovery cache did not follow the failover"
            statuses.append(call(http, live.url, "tools/list", headers=auth).status)
            time.sleep(0.1)
    assert promoted and len(statuses) > 10 and set(statuses) == {200}


def cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too and still a valid port."""
    while True:
        port = free_port()
        if port <= 55535:
            try:
                with socket.socket() as bus:
                    bus.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                pass


@requires_redis_server
@pytest.mark.skipif(REDIS_CLI is None, reason="redis-cli not installed")
async def test_a_three_master_cluster(tmp_path: Path, servers: list[Server]) -> None:
    nodes = [
        Server(
            tmp_path,
            *("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{i}.conf"),
            pick_port=cluster_port,
        )
        for i in range(3)
    ]
    for node in nodes:
        servers.append(node.start())
    subprocess.run(
        [
            REDIS_CLI,
            "--cluster",
            "create",
            *(f"127.0.0.1:{n.port}" for n in nodes),
            "--cluster-yes",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    time.sleep(1.0)  # the cluster agrees on its slots
    budgets = Budgets(3, 0, f"redis+cluster://127.0.0.1:{nodes[0].port}", timeout_s=1.0)
    try:
        tenants = [f"tenant-{i}" for i in range(6)]  # spread over the masters' slots
        counts = [await admits(budgets, t, 4) for t in tenants]
        assert counts == [3] * 6 and not budgets.degraded
    finally:
        await budgets.close()
