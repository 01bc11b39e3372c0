"""Tenants of the HTTP server: who a request is (a name derived from its API key), the namespace
of its sessions, blocks and prefix cache, and what its quotas count."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

__all__ = ["Tenant", "TenantQuotaExceeded", "internal_id"]


class TenantQuotaExceeded(Exception):
    """A tenant reached its limit on sessions (``kind="sessions"``) or store bytes (``"bytes"``)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass
class _Usage:
    """A tenant's named sessions and the store bytes of each, from a listing (see
    ``ModelService._tenant_usage``) and this server's saves since."""

    sessions: dict[str, int] = field(default_factory=dict)  # internal id -> store bytes

    @property
    def nbytes(self) -> int:
        return sum(self.sessions.values())


@dataclass(frozen=True)
class Tenant:
    """Whose request this is: a name derived from the API key, or ``local`` without keys."""

    name: str

    @classmethod
    def of_key(cls, key: str | None) -> Tenant:
        if key is None:
            return cls("local")
        return cls("k" + hashlib.sha256(key.encode()).hexdigest()[:16])

    @property
    def prefix(self) -> str:
        return self.name + "/"

    def cache_salt(self, salt: str | None) -> str:
        """The worker's prefix-cache namespace: the tenant, then the request's own salt."""
        return self.name if salt is None else f"{self.name}:{salt}"


def internal_id(tenant: Tenant, session_id: str) -> str:
    return tenant.prefix + session_id
