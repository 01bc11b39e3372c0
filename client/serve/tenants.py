"""Tenants of the HTTP server: who a request is (a name derived from its API key), the namespace
of its sessions, blocks and prefix cache, and what its quotas count."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

__all__ = ["IMPLICIT", "RESPONSE", "Tenant", "TenantQuotaExceeded", "internal_id", "session_kind"]

#: The server's own sessions start with "~", which no public id can (SESSION_ID_PATTERN):
#: ``~i-<hex>`` reuse for requests naming no session (client/serve/reuse.py), ``~r-<hex>`` holds
#: stored responses (/v1/responses), and ``~<hex>`` is one request's stateless session (a choice
#: of n > 1), closed when it ends.
IMPLICIT = "~i-"
RESPONSE = "~r-"
NAMED = "named"
EPHEMERAL = "~"
_LOCAL = "local"  # the tenant of every request on a server without API keys


def session_kind(sid: str) -> str:
    """IMPLICIT, RESPONSE, EPHEMERAL or NAMED, for an internal (``tenant/id``) or public id."""
    rest = sid.split("/", 1)[-1]
    for kind in (IMPLICIT, RESPONSE, EPHEMERAL):
        if rest.startswith(kind):
            return kind
    return NAMED


class TenantQuotaExceeded(Exception):
    """A tenant reached its limit on sessions (``kind="sessions"``) or store bytes (``"bytes"``)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class _Usage:
    """A tenant's named sessions and the store bytes of each, and the bytes of its implicit and
    response sessions, from a listing (see ``ModelService._tenant_usage``) and this server's saves
    since."""

    sessions: dict[str, int] = field(default_factory=dict)  # internal id -> store bytes
    cached: dict[str, int] = field(default_factory=dict)  # implicit and response sessions: id -> bytes

    @property
    def nbytes(self) -> int:
        return sum(self.sessions.values()) + sum(self.cached.values())


@dataclass(frozen=True)
class Tenant:
    """Whose request this is: a name derived from the API key, or ``local`` without keys."""

    name: str

    @classmethod
    def of_key(cls, key: str | None) -> Tenant:
        if key is None:
            return cls(_LOCAL)
        return cls("k" + hashlib.sha256(key.encode()).hexdigest()[:16])

    def admission_party(self, client: tuple[str, int] | list | None) -> str:
        """Who shares the generation slots and the queue fairly with the others (admission.py):
        the tenant; on a server without keys, whose one tenant is everyone, the client's address
        (``client``: the ASGI scope's), so that one client's burst holds no other's request. Its
        sessions stay the tenant's."""
        if self.name != _LOCAL or not client:
            return self.name
        return f"{self.name}@{client[0]}"

    @property
    def prefix(self) -> str:
        return self.name + "/"

    def cache_salt(self, salt: str | None) -> str:
        """The worker's prefix-cache namespace: the tenant, then the request's own salt."""
        return self.name if salt is None else f"{self.name}:{salt}"


def internal_id(tenant: Tenant, session_id: str) -> str:
    return tenant.prefix + session_id
