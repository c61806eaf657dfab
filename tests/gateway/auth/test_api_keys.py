"""API keys: the keys file format, SIGHUP re-reads it, and the same identity guards /mcp,
/v1/*, /tokenize, /detokenize and /admin/* (each refusal worded for its front door); the
runtime LoRA routes are the operator's, as /admin/* is."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvgate.engine import AsyncLLM
from kvgate.gateway.auth.api_keys import ApiKeys, KeysFileError, parse_keys_file
from kvgate.gateway.auth.authenticator import OPERATOR_PATHS, Authenticator
from kvgate.gateway.auth.challenge import Challenge
from kvgate.gateway.mcp.errors import AUTH_ERROR_CODE
from kvgate.gateway.settings import Settings
from tests.gateway.live_server import LiveServer
from tests.gateway.wire import call

GENERATE = {"name": "generate", "arguments": {"prompt": "hi", "max_tokens": 2}}


def line(tenant: str, key: str) -> str:
    return f"{tenant}: {hashlib.sha256(key.encode()).hexdigest()}\n"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_the_keys_file_names_a_bad_line() -> None:
    good = line("acme", "k1")
    assert [t for t, _ in parse_keys_file("# tenants\n\n" + good)] == ["acme"]
    for bad in ("acme k1\n", "acme: abc\n", "bad tenant!: " + "0" * 64 + "\n"):
        with pytest.raises(KeysFileError, match="keys file line 2"):
            parse_keys_file(good + bad)


def test_a_reload_that_fails_keeps_the_keys_in_force(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(line("acme", "k1"))
    keys = ApiKeys("solo", str(path))
    assert keys.tenant_of("k1") == "acme" and keys.tenant_of("solo") == "default"
    path.write_text("garbage\n")
    keys.reload()
    assert keys.tenant_of("k1") == "acme"
    path.write_text(line("globex", "k2"))
    keys.reload()
    assert keys.tenant_of("k1") is None and keys.tenant_of("k2") == "globex"
    assert keys.tenant_of("solo") == "default"  # --api-key is not in the file


def test_a_keys_file_that_is_not_utf8_keeps_the_keys_and_says_why(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A non-UTF-8 file raised UnicodeDecodeError out of ``reload`` (inside the SIGHUP
    handler); now the keys in force stay and the log names the file and the byte."""
    path = tmp_path / "keys"
    path.write_text(line("acme", "k1"))
    keys = ApiKeys(None, str(path))
    path.write_bytes(b"acme: \xff\xfe" + b"0" * 62 + b"\n")
    with caplog.at_level("ERROR", logger="kvgate.auth"):
        keys.reload()
    assert keys.tenant_of("k1") == "acme"
    assert "previous keys stay in force" in caplog.text
    assert f"{path} is not UTF-8 text: byte 0xff at offset 6" in caplog.text
    with pytest.raises(KeysFileError, match="not UTF-8"):  # at startup: a reason, not a trace
        ApiKeys(None, str(path))


@pytest.fixture(scope="module")
def live(engine: AsyncLLM, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(line("acme", "acme-key") + line("globex", "globex-key"))
    with LiveServer(
        engine, api_keys_file=str(path), admin_api_key="root-key", allow_runtime_lora_updating=True
    ) as server:
        yield server


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as client:
        yield client


def test_mcp_refusals_are_json_rpc_with_the_challenge(http: httpx.Client, live: LiveServer) -> None:
    missing = call(http, live.url, "tools/call", GENERATE, name="generate")
    assert missing.status == 401
    assert missing.headers["www-authenticate"] == 'Bearer scope="kvgate:infer"'
    assert missing.error["code"] == AUTH_ERROR_CODE
    wrong = call(http, live.url, "tools/list", headers=bearer("nope"))
    assert wrong.status == 401
    assert wrong.headers["www-authenticate"] == (
        'Bearer error="invalid_token", error_description="The API key is not valid"'
    )
    ok = call(http, live.url, "tools/call", GENERATE, name="generate", headers=bearer("acme-key"))
    assert ok.status == 200 and not ok.result["isError"]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("POST", "/tokenize", {"prompt": "hi"}),
        ("POST", "/detokenize", {"tokens": [1, 2]}),
    ],
)
def test_openai_routes_need_the_key(
    http: httpx.Client, live: LiveServer, method: str, path: str, body: dict | None
) -> None:
    refused = http.request(method, live.base + path, json=body)
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Bearer")
    error = refused.json()["error"]
    assert error["type"] == "authentication_error" and error["code"] == "unauthenticated"
    wrong = http.request(method, live.base + path, json=body, headers=bearer("nope"))
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_token"
    ok = http.request(method, live.base + path, json=body, headers=bearer("globex-key"))
    assert ok.status_code == 200, ok.text


def test_health_and_metrics_stay_open_and_admin_needs_the_admin_key(
    http: httpx.Client, live: LiveServer
) -> None:
    for path in ("/healthz", "/readyz", "/metrics"):
        assert http.get(live.base + path).status_code == 200
    http.get(live.base + "/v1/models")
    http.get(live.base + "/v1/models", headers=bearer("nope"))
    metrics = http.get(live.base + "/metrics").text
    assert 'kvgate_rejected_requests_total{reason="invalid_token"}' in metrics
    assert 'kvgate_rejected_requests_total{reason="unauthenticated"}' in metrics
    reload = live.base + "/admin/catalog/reload"
    tenant = http.post(reload, headers=bearer("acme-key"))
    assert tenant.status_code == 403
    assert tenant.headers["www-authenticate"].startswith('Bearer error="insufficient_scope"')
    assert http.post(reload, headers=bearer("root-key")).status_code == 200
    assert http.post(live.base + "/mcp", headers=bearer("root-key")).status_code != 401


@pytest.mark.parametrize("path", sorted(OPERATOR_PATHS))
def test_a_tenant_cannot_change_the_adapters_every_tenant_runs(
    http: httpx.Client, live: LiveServer, path: str
) -> None:
    """Any tenant loaded, replaced (``load_inplace``) or unloaded an adapter by name: what
    another tenant's calls under that name ran. Now only the admin credential may."""
    body = {"lora_name": "shared", "lora_path": "/nonexistent/adapter"}
    tenant = http.post(live.base + path, json=body, headers=bearer("acme-key"))
    assert tenant.status_code == 403, tenant.text
    assert tenant.headers["www-authenticate"].startswith('Bearer error="insufficient_scope"')
    assert tenant.json()["error"]["code"] == "insufficient_scope"
    admin = http.post(live.base + path, json=body, headers=bearer("root-key"))
    assert admin.status_code not in (401, 403), admin.text  # the endpoint's own answer


async def test_without_an_admin_credential_no_tenant_changes_adapters(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(line("acme", "acme-key"))
    tenants = Authenticator(Settings(api_keys_file=str(keys)))
    for path in OPERATOR_PATHS:
        with pytest.raises(Challenge) as refused:
            await tenants.authenticate(path, ["Bearer acme-key"])
        assert refused.value.status == 403
    assert await Authenticator(Settings()).authenticate(path, []) is None  # no tenants: open


def test_sighup_rereads_the_keys_file(kvgate_factory, tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(line("acme", "old-key"))
    kvgate = kvgate_factory("--api-keys-file", str(path))
    url = kvgate.base + "/v1/models"
    assert httpx.get(url, headers=bearer("old-key")).status_code == 200
    assert httpx.get(url, headers=bearer("new-key")).status_code == 401
    path.write_text(line("acme", "new-key"))
    kvgate.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while httpx.get(url, headers=bearer("new-key")).status_code != 200:
        assert time.monotonic() < deadline, "SIGHUP did not re-read the keys file"
        time.sleep(0.1)
    assert httpx.get(url, headers=bearer("old-key")).status_code == 401


def test_sighup_with_a_non_utf8_keys_file_still_reloads_the_catalog(
    kvgate_factory, tmp_path: Path
) -> None:
    """The keys file's UnicodeDecodeError escaped the SIGHUP handler before the catalog
    reload was scheduled: the catalog stayed old. Now the old keys stay, the error is
    logged, and the same signal reloads the catalog."""
    keys, config = tmp_path / "keys", tmp_path / "catalog.json"
    keys.write_text(line("acme", "old-key"))
    config.write_text('{"instructions": "Before the signal."}')
    kvgate = kvgate_factory("--api-keys-file", str(keys), "--catalog-config", str(config))
    auth = bearer("old-key")
    keys.write_bytes(b"\xff\xfe\x00garbage\n")
    config.write_text('{"instructions": "After the signal."}')
    kvgate.process.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    with httpx.Client(timeout=30) as http:
        while (
            call(http, kvgate.url, "server/discover", headers=auth).result["instructions"]
            != "After the signal."
        ):
            assert time.monotonic() < deadline, "SIGHUP did not reload the catalog"
            time.sleep(0.05)
        assert http.get(kvgate.base + "/v1/models", headers=auth).status_code == 200
    assert kvgate.process.poll() is None
    errors = [e["message"] for e in kvgate.log_entries() if e.get("level") == "ERROR"]
    assert any("not UTF-8 text" in m and "previous keys stay in force" in m for m in errors)


def test_a_bad_keys_file_or_oauth_setting_stops_startup_with_its_reason(tmp_path: Path) -> None:
    bad = tmp_path / "keys"
    bad.write_text("acme: not-a-digest\n")
    done = subprocess.run(
        [sys.executable, "-m", "kvgate", "serve", "--port", "0", "--model", "tiny"]
        + ["--api-keys-file", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "keys line 1" in done.stderr.splitlines()[-1]
    with pytest.raises(ValueError, match="must be https"):
        Authenticator(
            Settings(
                oauth_issuer="https://idp.example.com",
                oauth_jwks_url="http://idp.example.com/jwks.json",
                oauth_resource="https://gw.example.com/mcp",
            )
        )
    with pytest.raises(ValueError, match="absolute URI"):
        Authenticator(
            Settings(
                oauth_issuer="https://idp.example.com",
                oauth_jwks_url="https://idp.example.com/jwks.json",
                oauth_resource="gw.example.com/mcp",
            )
        )


def test_the_official_openai_client_sends_the_key(live: LiveServer) -> None:
    with openai.OpenAI(base_url=live.base + "/v1", api_key="nope", max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError, match="not valid"):
            wrong.models.list()
    with openai.OpenAI(base_url=live.base + "/v1", api_key="acme-key", max_retries=0) as right:
        assert right.models.list().data
