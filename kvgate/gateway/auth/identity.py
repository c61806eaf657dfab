"""The caller an authenticated request belongs to, and what follows from it.

The identity rides in a context variable set by the auth middleware for the request's task
(tasks a request spawns copy it), so the admission limit and the prefix-cache salt follow
the tenant without each front door passing it along.

A tenant's salt is ``HMAC-SHA256(secret, tenant)``: a fleet sends it to its upstreams, where
anyone who can reach them must not be able to compute it from the tenant's name (and so
probe that tenant's cached prefixes). The secret is the one every gateway shares
(``--tenant-salt-secret-file``, set by fleet mode at startup) or, without one, a random
secret of this process: never a guessable salt, at the price of prefixes not shared across
gateways or restarts.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from contextvars import ContextVar
from dataclasses import dataclass

ALL_SCOPES = None  # an identity whose credential is not scoped (an API key)


@dataclass(frozen=True)
class Identity:
    """``tenant`` is namespaced by how it was proven (``key:acme``, ``jwt:<sub>``), so an API
    key tenant and a token subject that happen to share a name never share a cache."""

    tenant: str
    scopes: frozenset[str] | None  # None: every non-admin scope (API keys)
    admin: bool = False

    def has(self, required: tuple[str, ...]) -> bool:
        if self.admin:
            return True
        return self.scopes is ALL_SCOPES or set(required) <= self.scopes


MIN_SECRET_BYTES = 16
_salt_secret = secrets.token_bytes(32)  # this process's own until a shared one is set


def set_salt_secret(secret: bytes) -> None:
    global _salt_secret
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the tenant salt secret needs at least {MIN_SECRET_BYTES} bytes")
    _salt_secret = secret


def read_salt_secret(path: str | None, value: str | None) -> bytes | None:
    """The shared secret from its file (surrounding whitespace dropped) or its value; None
    when neither is given; ValueError for both, an unreadable file or a short secret."""
    if path and value:
        raise ValueError("give --tenant-salt-secret-file or KVGATE_TENANT_SALT_SECRET, not both")
    if path:
        try:
            with open(os.path.expanduser(path), "rb") as file:
                secret = file.read(1 << 16).strip()
        except OSError as exc:
            raise ValueError(f"cannot read --tenant-salt-secret-file {path}: {exc}") from None
    elif value:
        secret = value.strip().encode()
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the tenant salt secret needs at least {MIN_SECRET_BYTES} bytes")
    return secret


def salt_of(tenant: str) -> str:
    digest = hmac.new(_salt_secret, tenant.encode(), hashlib.sha256).hexdigest()
    return "tenant:" + digest[:32]


CURRENT: ContextVar[Identity | None] = ContextVar("kvgate_identity", default=None)


def current() -> Identity | None:
    return CURRENT.get()


def current_tenant() -> str:
    """The caller's tenant ("" on a server without authentication): what every object a
    caller stores or names (a task, a stored response) is scoped to."""
    identity = CURRENT.get()
    return "" if identity is None else identity.tenant


def tenant_salt(client_salt: str | None) -> str | None:
    """The engine ``cache_salt`` for this request: the tenant's own, combined with the one the
    client chose (which can only split the tenant's cache further, never reach another's)."""
    identity = CURRENT.get()
    if identity is None:
        return client_salt
    root = salt_of(identity.tenant)
    return root if client_salt is None else f"{root}/{client_salt}"
