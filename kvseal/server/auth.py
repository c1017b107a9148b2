"""API keys → tenants (the engines derive each tenant's prefix-cache namespace, I5).

The keys file is JSON: `{"KEY": {"tenant": "NAME", "max_concurrent_requests": N,
"max_tokens": N, "admin": true}}` (limits and admin optional). Keys are held only as SHA-256
digests and never logged. Without a keys file every request runs as the single tenant
`default` and the operator routes (`/metrics`) are open; with one, they need an admin key.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.datastructures import Headers

from kvseal._testing.faults import Fault, is_active
from kvseal.errors import ConfigError
from kvseal.server import errors
from kvseal.types import DEFAULT_TENANT

_FIELDS = {"tenant", "max_concurrent_requests", "max_tokens", "admin"}


@dataclass(frozen=True)
class Tenant:
    name: str
    max_concurrent_requests: int | None = None
    max_tokens: int | None = None


class ApiKeyTable:
    """Authenticates `Authorization: Bearer KEY`; open (one tenant) when built without keys."""

    def __init__(self, tenants_by_digest: dict[bytes, Tenant] | None = None,
                 admin_digests: frozenset[bytes] = frozenset()) -> None:
        self._by_digest = tenants_by_digest
        self._admin_digests = admin_digests
        self._open_tenant = Tenant(DEFAULT_TENANT)

    @property
    def is_open(self) -> bool:
        return self._by_digest is None

    @property
    def tenants(self) -> list[Tenant]:
        if self._by_digest is None:
            return [self._open_tenant]
        return sorted(set(self._by_digest.values()), key=lambda t: t.name)

    @classmethod
    def load(cls, path: str | None) -> ApiKeyTable:
        if path is None:
            return cls()
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the API keys file {path}: {exc}") from exc
        return cls(*_parse_keys(raw, path))

    def authenticate(self, authorization: str | None) -> Tenant:
        """The caller's tenant, or an `ApiError` 401."""
        if self._by_digest is None:
            return self._open_tenant
        tenant = self._by_digest.get(_bearer_digest(authorization))
        if tenant is None:
            raise errors.invalid_api_key()
        return tenant

    def authenticate_admin(self, authorization: str | None) -> None:
        """Pass an admin key (or anyone, without a keys file); else `ApiError` 401, or 403 for a
        valid key without `"admin": true`."""
        if self._by_digest is None:
            return
        self.authenticate(authorization)
        if _bearer_digest(authorization) not in self._admin_digests:
            raise errors.admin_required()


def authorization_of(headers: Headers) -> str | None:
    """The request's one Authorization header (None without one); `ApiError` 400 when it has
    several: which of them counts is ambiguous (proxies and frameworks disagree), so none does."""
    values = headers.getlist("authorization")
    if len(values) > 1 and not is_active(Fault.SKIP_DOOR_CHECKS):
        raise errors.duplicate_authorization(len(values))
    return values[0] if values else None


def _bearer_digest(authorization: str | None) -> bytes:
    """The digest of the `Authorization: Bearer KEY` key, or `ApiError` 401 without one."""
    scheme, _, key = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise errors.missing_api_key()
    return _digest(key.strip())


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _parse_keys(raw: Any, path: str) -> tuple[dict[bytes, Tenant], frozenset[bytes]]:
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{path} must be a non-empty JSON object mapping each API key to "
                          f'{{"tenant": NAME, ...}}')
    by_digest: dict[bytes, Tenant] = {}
    by_name: dict[str, Tenant] = {}
    admins: set[bytes] = set()
    for index, (key, entry) in enumerate(raw.items()):
        where = f"{path}, entry {index + 1}"  # never the key itself: it is a secret
        if not key.strip() or key != key.strip() or " " in key:
            raise ConfigError(f"{where}: an API key must be non-empty and contain no spaces")
        tenant = _parse_entry(entry, where)
        if by_name.setdefault(tenant.name, tenant) != tenant:
            raise ConfigError(f"{where}: tenant '{tenant.name}' appears with different limits; give every "
                              f"key of a tenant the same limits")
        by_digest[_digest(key)] = tenant
        if _is_admin(entry, where):
            admins.add(_digest(key))
    return by_digest, frozenset(admins)


def _is_admin(entry: dict[str, Any], where: str) -> bool:
    value = entry.get("admin", False)
    if not isinstance(value, bool):
        raise ConfigError(f'{where}: "admin" must be true or false, got {value!r}')
    return value


def _parse_entry(entry: Any, where: str) -> Tenant:
    if not isinstance(entry, dict):
        raise ConfigError(f'{where}: the value must be an object like {{"tenant": "NAME"}}')
    unknown = sorted(set(entry) - _FIELDS)
    if unknown:
        raise ConfigError(f"{where}: unknown fields {unknown}; allowed: {sorted(_FIELDS)}")
    name = entry.get("tenant")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f'{where}: "tenant" must be a non-empty string')
    return Tenant(name, _positive(entry, "max_concurrent_requests", where), _positive(entry, "max_tokens", where))


def _positive(entry: dict[str, Any], field: str, where: str) -> int | None:
    value = entry.get(field)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f'{where}: "{field}" must be an integer >= 1, got {value!r}')
    return value
