"""The caller an authenticated request belongs to, and what follows from it.

The identity rides in a context variable set by the auth middleware for the request's task
(tasks a request spawns copy it), so the admission limit and the prefix-cache salt follow
the tenant without each front door passing it along.
"""

from __future__ import annotations

import hashlib
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


CURRENT: ContextVar[Identity | None] = ContextVar("kvgate_identity", default=None)


def current() -> Identity | None:
    return CURRENT.get()


def tenant_salt(client_salt: str | None) -> str | None:
    """The engine ``cache_salt`` for this request: the tenant's own, combined with the one the
    client chose (which can only split the tenant's cache further, never reach another's)."""
    identity = CURRENT.get()
    if identity is None:
        return client_salt
    root = "tenant:" + hashlib.sha256(identity.tenant.encode()).hexdigest()[:32]
    return root if client_salt is None else f"{root}/{client_salt}"
