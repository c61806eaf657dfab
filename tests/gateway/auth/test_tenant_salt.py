"""The tenant salt is HMAC-SHA256(server secret, tenant): nobody who can reach an upstream
computes it from the tenant's name. The shared secret comes from
``--tenant-salt-secret-file`` (or ``KVGATE_TENANT_SALT_SECRET``); without one each process
draws its own. A fleet gateway (a real process, in front of ``recording_upstream``) sends
exactly that salt."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate.gateway.auth import identity
from kvgate.gateway.auth.identity import CURRENT, Identity, read_salt_secret, tenant_salt
from tests.gateway.upstream import recording_upstream
from tests.gateway.upstream.processes import Process, gateway, running

SECRET = b"0123456789abcdef-shared-by-every-gateway"
KEY = "acme-key"


def expected(secret: bytes, tenant: str) -> str:
    return "tenant:" + hmac.new(secret, tenant.encode(), hashlib.sha256).hexdigest()[:32]


@pytest.fixture
def restore_secret() -> Iterator[None]:
    saved = identity._salt_secret
    yield
    identity._salt_secret = saved


def salted(tenant: str, client_salt: str | None = None) -> str | None:
    token = CURRENT.set(Identity(tenant, None))
    try:
        return tenant_salt(client_salt)
    finally:
        CURRENT.reset(token)


def test_the_salt_is_an_hmac_of_the_tenant_under_the_secret(restore_secret: None) -> None:
    identity.set_salt_secret(SECRET)
    assert salted("key:acme") == expected(SECRET, "key:acme")
    assert salted("key:acme", "mine") == expected(SECRET, "key:acme") + "/mine"
    unkeyed = "tenant:" + hashlib.sha256(b"key:acme").hexdigest()[:32]
    assert salted("key:acme") != unkeyed  # the old, computable salt
    identity.set_salt_secret(SECRET + b"-other")
    assert salted("key:acme") != expected(SECRET, "key:acme")


def test_without_a_shared_secret_the_process_has_its_own() -> None:
    assert len(identity._salt_secret) == 32  # random, drawn at import
    assert salted("key:acme") != expected(b"", "key:acme")


def test_the_secret_is_read_from_a_file_or_a_value(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    assert read_salt_secret(str(path), None) == SECRET
    assert read_salt_secret(None, SECRET.decode()) == SECRET
    assert read_salt_secret(None, None) is None
    for bad in ((str(path), "x" * 20), (str(tmp_path / "missing"), None), (None, "short")):
        with pytest.raises(ValueError):
            read_salt_secret(*bad)


def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text(f"acme: {hashlib.sha256(KEY.encode()).hexdigest()}\n")
    return path


def test_a_fleet_gateway_sends_the_keyed_salt_upstream(tmp_path: Path) -> None:
    secret = tmp_path / "salt-secret"
    secret.write_bytes(SECRET + b"\n")
    recorder = Process(tmp_path, command=("-m", "tests.gateway.upstream.recording_upstream"))
    flags = ("--api-keys-file", str(keys_file(tmp_path)), "--tenant-salt-secret-file", str(secret))
    with running([recorder], 30):
        gateways = [gateway(tmp_path, [recorder], *flags) for _ in range(2)]
        with running(gateways, 60):
            for g in gateways:
                body = {"model": recording_upstream.MODEL, "prompt": "hi", "max_tokens": 1}
                answer = httpx.post(
                    g.base + "/v1/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {KEY}"},
                    timeout=10,
                )
                assert answer.status_code == 200, answer.text
            recorded = httpx.get(recorder.base + "/recorded", timeout=5).json()
    salts = [r["body"]["cache_salt"] for r in recorded if r["path"] == "/v1/completions"]
    assert salts == [expected(SECRET, "key:acme")] * 2  # every gateway alike
