"""Which requests need a credential, which scopes they need, and whose credential it is.

Authentication is on when API keys or an OAuth issuer are configured (off by default: a
loopback-only server is reached only by its own host). Then every path needs a credential
except ``/healthz``, ``/readyz``, ``/metrics``, the protected-resource metadata and the web
console's pages (they hold no data: the page sends the key the operator types into it).
``/admin/*`` always needs the admin key or a token with the admin scope. So do, once
authentication is on, the runtime LoRA routes (``OPERATOR_PATHS``): adapters are one namespace
served to every tenant, and a tenant that loaded, replaced or unloaded one would change what
another tenant's calls run. A bearer credential is tried as an API key first (a hash), then as
a JWT access token.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

from kvgate.gateway.auth.api_keys import ApiKeys
from kvgate.gateway.auth.challenge import Challenge
from kvgate.gateway.auth.identity import Identity
from kvgate.gateway.auth.oauth import InvalidToken, OAuthConfig, TokenValidator
from kvgate.gateway.console.routes import is_console
from kvgate.gateway.http.security import LOOPBACK_NAMES
from kvgate.gateway.settings import Settings
from kvgate.protocol.methods import TASK_METHODS

log = logging.getLogger("kvgate.auth")
B64TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")  # RFC 6750 section 2.1: a bearer token
OPEN_PATHS = frozenset(("/healthz", "/readyz", "/metrics"))
METADATA_PATH = "/.well-known/oauth-protected-resource"
OPERATOR_PATHS = frozenset(("/v1/load_lora_adapter", "/v1/unload_lora_adapter"))


def metadata_url(resource: str) -> str:
    """RFC 9728 section 3.1: the well-known path goes between the host and the resource's path."""
    parts = urlsplit(resource)
    return f"{parts.scheme}://{parts.netloc}{METADATA_PATH}{parts.path.rstrip('/')}"


class Authenticator:
    def __init__(self, settings: Settings, inference_paths: Iterable[str] = ()) -> None:
        """``inference_paths``: the routes that run inference (they need the inference scope;
        the doors name them)."""
        self.inference_paths = frozenset(inference_paths)
        self.api_keys = ApiKeys(settings.api_key, settings.api_keys_file)
        self._admin = (
            hashlib.sha256(settings.admin_api_key.encode()).digest()
            if settings.admin_api_key
            else None
        )
        self.inference_scope = settings.oauth_inference_scope
        self.admin_scope = settings.oauth_admin_scope
        self.oauth: TokenValidator | None = None
        self.resource_metadata: str | None = None
        self.metadata_paths: frozenset[str] = frozenset()  # where the metadata is served
        if settings.oauth_issuer:
            if not (settings.oauth_jwks_url and settings.oauth_resource):
                raise ValueError("oauth_issuer needs oauth_jwks_url and oauth_resource")
            jwks = urlsplit(settings.oauth_jwks_url)
            if jwks.scheme != "https" and (jwks.hostname or "") not in LOOPBACK_NAMES:
                raise ValueError(
                    "oauth_jwks_url must be https (keys fetched in clear can be forged)"
                )
            resource = urlsplit(settings.oauth_resource)
            if not (resource.scheme and resource.netloc) or resource.fragment:
                raise ValueError("oauth_resource must be an absolute URI without a fragment")
            config = OAuthConfig(
                issuer=settings.oauth_issuer,
                jwks_url=settings.oauth_jwks_url,
                resource=settings.oauth_resource,
                tenant_claim=settings.oauth_tenant_claim,
                leeway_s=settings.oauth_leeway_s,
                min_refresh_s=settings.oauth_jwks_min_refresh_s,
            )
            self.oauth = TokenValidator(config)
            self.resource_metadata = metadata_url(config.resource)
            self.metadata_paths = frozenset((METADATA_PATH, urlsplit(self.resource_metadata).path))
        self.enabled = bool(self.api_keys) or self.oauth is not None
        self.admin_enabled = self._admin is not None or self.oauth is not None
        if not self.enabled and settings.host.strip("[]").lower() not in LOOPBACK_NAMES:
            log.warning(
                "serving on %s with no authentication: anyone who reaches the port can use it "
                "(set --api-key, --api-keys-file or --oauth-issuer)",
                settings.host,
            )

    def metadata(self, server_name: str) -> dict[str, object]:
        """The Protected Resource Metadata document (RFC 9728 section 2)."""
        assert self.oauth is not None
        return {
            "resource": self.oauth.config.resource,
            "authorization_servers": [self.oauth.config.issuer],
            "scopes_supported": [self.inference_scope],
            "bearer_methods_supported": ["header"],
            "resource_name": server_name,
        }

    def required(self, path: str) -> tuple[str, ...]:
        """The scopes a path needs before its endpoint runs (``/mcp`` checks per method)."""
        if path.startswith("/admin/") or path in OPERATOR_PATHS:
            return (self.admin_scope,)
        return (self.inference_scope,) if path in self.inference_paths else ()

    def call_scopes(self, method: str) -> tuple[str, ...]:
        """The scopes an MCP method needs: running a tool takes the inference scope; discovery
        (lists, reads, ping) takes only a valid credential; a task's methods are its call's."""
        inference = method == "tools/call" or method in TASK_METHODS
        return (self.inference_scope,) if inference else ()

    async def authenticate(self, path: str, authorization: list[str]) -> Identity | None:
        """The caller's identity (None when this path needs none); raises Challenge.
        ``authorization``: every ``Authorization`` header sent (two are ambiguous: 400)."""
        admin = path.startswith("/admin/")
        if path in OPEN_PATHS or path.startswith(METADATA_PATH) or is_console(path):
            return None
        if not (self.admin_enabled if admin else self.enabled):
            return None
        required = self.required(path)
        if len(authorization) > 1:
            raise self.challenge(400, "invalid_request", "More than one Authorization header")
        scheme, _, token = (authorization[0] if authorization else "").partition(" ")
        if scheme.lower() != "bearer":  # the scope guidance: what this path, or any call, needs
            guidance = required or (self.inference_scope,)
            raise self.challenge(
                401, None, "Authentication required: send Authorization: Bearer <token>", guidance
            )
        token = token.strip(" \t")
        if not B64TOKEN.fullmatch(token):
            raise self.challenge(400, "invalid_request", "Malformed Authorization header")
        identity = await self._identify(token)
        if (admin or path in OPERATOR_PATHS) and not identity.admin:
            raise self.challenge(403, "insufficient_scope", "This needs the admin scope", required)
        self.require(identity, required)
        return identity

    def require(self, identity: Identity | None, required: tuple[str, ...]) -> None:
        if identity is not None and not identity.has(required):
            raise self.challenge(
                403, "insufficient_scope", "The access token lacks a scope this needs", required
            )

    def challenge(
        self, status: int, error: str | None, description: str, scope: tuple[str, ...] = ()
    ) -> Challenge:
        return Challenge(status, error, description, scope, self.resource_metadata)

    async def _identify(self, token: str) -> Identity:
        given = hashlib.sha256(token.encode()).digest()
        if self._admin is not None and hmac.compare_digest(given, self._admin):
            return Identity("admin", frozenset(), admin=True)
        tenant = self.api_keys.tenant_of(token)
        if tenant is not None:
            return Identity("key:" + tenant, None)
        if self.oauth is None or token.count(".") != 2:
            raise self.challenge(401, "invalid_token", "The API key is not valid")
        try:
            identity = await self.oauth.identity(token)
        except InvalidToken as exc:
            raise self.challenge(401, "invalid_token", str(exc)) from None
        if identity.scopes is not None and self.admin_scope in identity.scopes:
            return Identity(identity.tenant, identity.scopes, admin=True)
        return identity
