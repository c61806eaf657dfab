"""OAuth 2.1 resource-server auth over real HTTP, against a real JWKS server on loopback:
every outcome with its status, ``WWW-Authenticate`` and body, on ``/mcp`` and ``/v1``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvgate.engine import AsyncLLM
from kvgate.gateway.mcp.errors import AUTH_ERROR_CODE
from tests.gateway.auth.issuer import ISSUER, RESOURCE, Issuer
from tests.gateway.live_server import LiveServer
from tests.gateway.wire import call

METADATA = "https://gateway.example.test/.well-known/oauth-protected-resource/mcp"
GENERATE = {"name": "generate", "arguments": {"prompt": "hi", "max_tokens": 2}}


@pytest.fixture(scope="module")
def issuer() -> Iterator[Issuer]:
    server = Issuer()
    yield server
    server.close()


@pytest.fixture(scope="module")
def live(engine: AsyncLLM, issuer: Issuer) -> Iterator[LiveServer]:
    with LiveServer(
        engine,
        oauth_issuer=ISSUER,
        oauth_jwks_url=issuer.jwks_url,
        oauth_resource=RESOURCE,
        oauth_jwks_min_refresh_s=1.0,
    ) as server:
        yield server


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=60) as client:
        yield client


def mcp(http: httpx.Client, live: LiveServer, token: str | None, params: dict[str, Any] = GENERATE):
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return call(http, live.url, "tools/call", params, name="generate", headers=headers)


def challenge(exchange: Any) -> str:
    return exchange.headers["www-authenticate"]


def test_the_protected_resource_metadata_names_the_issuer(
    http: httpx.Client, live: LiveServer
) -> None:
    for path in (
        "/.well-known/oauth-protected-resource",
        "/.well-known/oauth-protected-resource/mcp",
    ):
        document = http.get(live.base + path).json()
        assert document["resource"] == RESOURCE
        assert document["authorization_servers"] == [ISSUER]
        assert document["scopes_supported"] == ["kvgate:infer"]
        assert document["bearer_methods_supported"] == ["header"]


def test_missing_token_is_401_pointing_at_the_metadata(
    http: httpx.Client, live: LiveServer
) -> None:
    refused = mcp(http, live, None)
    assert refused.status == 401
    assert challenge(refused) == f'Bearer resource_metadata="{METADATA}", scope="kvgate:infer"'
    assert refused.error["code"] == AUTH_ERROR_CODE and "id" not in refused.body
    openai = http.post(live.base + "/v1/completions", json={"prompt": "hi"})
    assert openai.status_code == 401
    assert openai.headers["www-authenticate"] == (
        f'Bearer resource_metadata="{METADATA}", scope="kvgate:infer"'
    )
    assert openai.json()["error"]["type"] == "authentication_error"
    assert http.get(live.base + "/healthz").status_code == 200  # open
    assert http.get(live.base + "/metrics").status_code == 200


def test_malformed_authorization_is_400_invalid_request(
    http: httpx.Client, live: LiveServer, issuer: Issuer
) -> None:
    refused = call(
        http,
        live.url,
        "tools/call",
        GENERATE,
        name="generate",
        headers={"Authorization": "Bearer a b"},
    )
    assert refused.status == 400
    assert challenge(refused).startswith('Bearer error="invalid_request", resource_metadata=')
    basic = call(
        http,
        live.url,
        "tools/call",
        GENERATE,
        name="generate",
        headers={"Authorization": "Basic eA=="},
    )
    assert basic.status == 401 and challenge(basic).startswith("Bearer resource_metadata=")
    twice = httpx.post(
        live.url,
        content=b"{}",
        headers=[("Authorization", f"Bearer {issuer.token()}"), ("Authorization", "Bearer x")],
    )
    assert twice.status_code == 400 and "More than one" in twice.json()["error"]["message"]


def invalid(exchange: Any, description: str) -> None:
    assert exchange.status == 401
    header = challenge(exchange)
    assert header.startswith(f'Bearer error="invalid_token", resource_metadata="{METADATA}"'), (
        header
    )
    assert description in header and description in exchange.error["message"]
    assert exchange.error["data"] == {"reason": "invalid_token"}


def test_a_valid_token_runs_the_tool(http: httpx.Client, live: LiveServer, issuer: Issuer) -> None:
    ok = mcp(http, live, issuer.token())
    assert ok.status == 200 and not ok.result["isError"]


def test_not_a_jwt_and_a_wrong_signature_are_invalid_token(
    http: httpx.Client, live: LiveServer, issuer: Issuer
) -> None:
    invalid(mcp(http, live, "not.a.jwt"), "not a well-formed JWT")
    header, payload, _ = issuer.token().split(".")
    forged = issuer.token(sub="mallory").split(".")[2]  # another token's signature
    invalid(mcp(http, live, f"{header}.{payload}.{forged}"), "signature does not verify")


def test_another_audience_or_issuer_is_refused(
    http: httpx.Client, live: LiveServer, issuer: Issuer
) -> None:
    invalid(mcp(http, live, issuer.token(aud="https://other.example.test/mcp")), "not issued for")
    invalid(mcp(http, live, issuer.token(aud=None)), "invalid")
    invalid(mcp(http, live, issuer.token(iss="https://evil.example.test")), "issuer is not trusted")


def test_expired_and_not_yet_valid_tokens_are_refused_beyond_the_leeway(
    http: httpx.Client, live: LiveServer, issuer: Issuer
) -> None:
    now = int(time.time())
    invalid(mcp(http, live, issuer.token(exp=now - 120)), "expired")
    invalid(mcp(http, live, issuer.token(nbf=now + 120)), "not valid yet")
    assert mcp(http, live, issuer.token(exp=now - 5)).status == 200  # within 30 s leeway


def test_an_unknown_kid_refreshes_the_jwks_once(
    http: httpx.Client, live: LiveServer, issuer: Issuer
) -> None:
    assert mcp(http, live, issuer.token()).status == 200
    time.sleep(1.1)  # past the refresh bound (1 s here, 10 s by default)
    before = issuer.fetches
    issuer.add_key("ec-2", "ES256")  # the issuer rotates in a new key
    assert mcp(http, live, issuer.token("ec-2")).status == 200
    assert issuer.fetches == before + 1
    issuer.add_key("ghost", "ES256", publish=False)  # signed with a key nobody published
    for _ in range(3):
        invalid(mcp(http, live, issuer.token("ghost")), "not in the issuer's JWKS")
    assert issuer.fetches <= before + 2  # refreshes are bounded (at most one per 10 s)


def test_insufficient_scope_is_403_with_every_needed_scope(
    http: httpx.Client, live: LiveServer, issuer: Issuer
) -> None:
    token = issuer.token(scope="profile")
    refused = mcp(http, live, token)
    assert refused.status == 403
    assert challenge(refused) == (
        f'Bearer error="insufficient_scope", scope="kvgate:infer", '
        f'resource_metadata="{METADATA}", '
        'error_description="The access token lacks a scope this needs"'
    )
    assert refused.body["id"] == 1 and refused.error["data"] == {"reason": "insufficient_scope"}
    listing = call(http, live.url, "tools/list", headers={"Authorization": f"Bearer {token}"})
    assert listing.status == 200 and listing.result["tools"]  # discovery needs no scope
    openai = http.post(
        live.base + "/v1/completions",
        json={"prompt": "hi"},
        headers={"Authorization": f"Bearer {token}"},
    )
    assert openai.status_code == 403 and openai.json()["error"]["type"] == "permission_error"
    admin = http.post(
        live.base + "/admin/catalog/reload", headers={"Authorization": f"Bearer {issuer.token()}"}
    )
    assert admin.status_code == 403 and 'scope="kvgate:admin"' in admin.headers["www-authenticate"]
    reload = http.post(
        live.base + "/admin/catalog/reload",
        headers={"Authorization": f"Bearer {issuer.token(scope='kvgate:admin')}"},
    )
    assert reload.status_code == 200 and reload.json()["changed"] is False


def test_a_withdrawn_key_ends_its_remembered_tokens(
    http: httpx.Client, live: LiveServer, issuer: Issuer
) -> None:
    issuer.add_key("ec-3", "ES256")
    time.sleep(1.1)  # past the refresh bound, so the unknown kid fetches the JWKS
    token = issuer.token("ec-3")
    assert mcp(http, live, token).status == 200
    assert mcp(http, live, token).status == 200  # remembered: no second signature check
    issuer.published.remove("ec-3")  # the issuer withdraws the key
    time.sleep(1.1)
    issuer.add_key("ec-4", "ES256")
    assert mcp(http, live, issuer.token("ec-4")).status == 200  # this re-fetches the JWKS
    invalid(mcp(http, live, token), "not in the issuer's JWKS")
