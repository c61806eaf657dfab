"""OAuth 2.1 resource server: JWT access tokens checked against the issuer's JWKS (PyJWT).

A token is accepted when its signature verifies with a key from the JWKS named by its
``kid``, under an asymmetric algorithm the key allows; ``iss`` is the configured issuer;
``aud`` names this resource (RFC 8707: a token minted for another server is refused, never
passed on); and ``exp``/``nbf`` hold within a small leeway. The JWKS is fetched on first use,
kept for ``ttl_s``, and re-fetched at once for an unknown ``kid`` (a rotated key) — but at
most once per ``min_refresh_s``, so tokens with invented kids cannot make the gateway hammer
the issuer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import httpx
import jwt

from kvgate.gateway.auth.identity import Identity

log = logging.getLogger("kvgate.auth")
ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "EdDSA")
MAX_JWKS_BYTES = 256 * 1024
MAX_VERIFIED = 4096  # verified tokens remembered


class InvalidToken(Exception):
    """The token is not acceptable here; the message says why (sent as error_description)."""


@dataclass(frozen=True)
class OAuthConfig:
    issuer: str
    jwks_url: str
    resource: str  # this server's canonical URI: the audience tokens must name
    tenant_claim: str = "sub"
    leeway_s: float = 30.0
    ttl_s: float = 300.0
    min_refresh_s: float = 10.0
    fetch_timeout_s: float = 5.0


class Jwks:
    """The issuer's signing keys by ``kid``, fetched lazily and refreshed (bounded)."""

    def __init__(self, config: OAuthConfig) -> None:
        self.config = config
        self._keys: dict[str, tuple[jwt.PyJWK, str | None]] = {}  # kid -> (key, its "alg")
        self._fetched_at = -float("inf")
        self._lock = asyncio.Lock()
        self.fetches = 0

    async def key(self, kid: str) -> tuple[jwt.PyJWK, str | None] | None:
        if kid not in self._keys or time.monotonic() - self._fetched_at > self.config.ttl_s:
            await self._refresh()
        return self._keys.get(kid)

    async def _refresh(self) -> None:
        async with self._lock:  # concurrent misses share one fetch
            if time.monotonic() - self._fetched_at < self.config.min_refresh_s:
                return
            self._fetched_at = time.monotonic()  # a failed fetch also waits min_refresh_s
            self.fetches += 1
            try:
                self._keys = await self._fetch()
            except (httpx.HTTPError, ValueError) as exc:
                log.warning("JWKS fetch from %s failed: %s", self.config.jwks_url, exc)

    async def _fetch(self) -> dict[str, tuple[jwt.PyJWK, str | None]]:
        async with httpx.AsyncClient(timeout=self.config.fetch_timeout_s) as client:
            response = await client.get(self.config.jwks_url)
        response.raise_for_status()
        if len(response.content) > MAX_JWKS_BYTES:
            raise ValueError(f"JWKS larger than {MAX_JWKS_BYTES} bytes")
        keys: dict[str, tuple[jwt.PyJWK, str | None]] = {}
        for entry in response.json().get("keys", []):
            if not isinstance(entry, dict) or not isinstance(entry.get("kid"), str):
                continue
            if entry.get("use", "sig") != "sig":
                continue
            try:
                keys[entry["kid"]] = (jwt.PyJWK(entry), entry.get("alg"))
            except jwt.PyJWTError as exc:
                log.warning("JWKS key %s skipped: %s", entry["kid"], exc)
        return keys


class TokenValidator:
    """Verifies tokens; a verified one is remembered (by digest, ``MAX_VERIFIED`` at most)
    until it expires or the JWKS is re-fetched (a key withdrawn ends its tokens), so a client
    reusing its token pays for one signature check, not one per request."""

    def __init__(self, config: OAuthConfig) -> None:
        self.config = config
        self.jwks = Jwks(config)
        self._verified: OrderedDict[bytes, tuple[Identity, float]] = OrderedDict()
        self._verified_for = 0  # the JWKS fetch count the remembered tokens were checked under

    async def identity(self, token: str) -> Identity:
        """The token's identity, or InvalidToken saying what is wrong with it."""
        digest = hashlib.sha256(token.encode()).digest()
        if self._verified_for != self.jwks.fetches:
            self._verified.clear()
            self._verified_for = self.jwks.fetches
        known = self._verified.get(digest)
        if known is not None and time.time() < known[1] + self.config.leeway_s:
            self._verified.move_to_end(digest)
            return known[0]
        identity, expires = await self._verify(token)
        if self._verified_for == self.jwks.fetches:  # not checked against a JWKS since replaced
            self._verified[digest] = (identity, expires)
            if len(self._verified) > MAX_VERIFIED:
                self._verified.popitem(last=False)
        return identity

    async def _verify(self, token: str) -> tuple[Identity, float]:
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise InvalidToken("The access token is not a well-formed JWT") from None
        alg, kid = header.get("alg"), header.get("kid")
        if alg not in ALGORITHMS:
            raise InvalidToken(f"The token's algorithm {alg!r} is not accepted")
        if not isinstance(kid, str):
            raise InvalidToken("The token names no signing key (kid)")
        found = await self.jwks.key(kid)
        if found is None:
            raise InvalidToken(f"The token's signing key {kid!r} is not in the issuer's JWKS")
        key, key_alg = found
        if key_alg is not None and key_alg != alg:  # a key pinned to one algorithm keeps to it
            raise InvalidToken(f"Key {kid!r} does not sign with {alg}")
        try:
            claims = jwt.decode(
                token,
                key.key,
                algorithms=[alg],
                audience=self.config.resource,
                issuer=self.config.issuer,
                leeway=self.config.leeway_s,
                options={"require": ["exp", "iss", "aud", self.config.tenant_claim]},
            )
        except jwt.ExpiredSignatureError:
            raise InvalidToken("The access token has expired") from None
        except jwt.ImmatureSignatureError:
            raise InvalidToken("The access token is not valid yet (nbf)") from None
        except jwt.InvalidAudienceError:
            raise InvalidToken(
                f"The access token was not issued for {self.config.resource}"
            ) from None
        except jwt.InvalidIssuerError:
            raise InvalidToken("The access token's issuer is not trusted here") from None
        except jwt.InvalidSignatureError:
            raise InvalidToken("The access token's signature does not verify") from None
        except jwt.PyJWTError as exc:
            raise InvalidToken(f"The access token is invalid: {exc}") from None
        tenant = claims[self.config.tenant_claim]
        if not isinstance(tenant, str) or not tenant:
            raise InvalidToken(f"The token's {self.config.tenant_claim!r} claim is not a string")
        return Identity("jwt:" + tenant, _scopes(claims)), float(claims["exp"])


def _scopes(claims: dict[str, Any]) -> frozenset[str]:
    """``scope`` (RFC 9068: space-separated) or ``scp`` (a list, as some issuers send)."""
    scope = claims.get("scope")
    if isinstance(scope, str):
        return frozenset(scope.split())
    scp = claims.get("scp")
    if isinstance(scp, list):
        return frozenset(s for s in scp if isinstance(s, str))
    return frozenset()
