"""API keys → tenants (the engines derive each tenant's prefix-cache namespace, I5).

The keys file is JSON, one entry per key:

    {"KEY": {"tenant": "NAME", "max_concurrent_requests": N, "max_tokens": N,
             "requests_per_minute": N, "tokens_per_minute": N, "admin": true, "revoked": false}}

Every field but `tenant` is optional. A key may be written as its digest, `"sha256:<64 hex>"`
(`printf %s KEY | sha256sum`), so the file need not hold the secret itself. Keys are held only
as SHA-256 digests, compared in constant time, and never logged (the audit log names a key by
its `key_id`). A `"revoked": true` entry is refused like a missing one; it lets the
operator keep a record of the key in the file.

Admin keys are entries with `"admin": true` in the same file: the operator routes (`/metrics`,
`/admin/...`) then follow every reload like the tenants do, and an admin key can be stored
hashed and revoked the same way. Without a keys file every request runs as the single tenant
`default` and the operator routes are open (bind loopback only, as the server warns).

The table is replaced whole on reload (`kvseal.server.admin`): a file that does not parse
leaves the old table in place.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.datastructures import Headers

from kvseal._testing.faults import Fault, is_active
from kvseal.errors import ConfigError
from kvseal.server import errors
from kvseal.server.audit import KEY_ID_HEX_DIGITS
from kvseal.types import DEFAULT_TENANT

_FIELDS = {"tenant", "max_concurrent_requests", "max_tokens", "requests_per_minute", "tokens_per_minute", "admin",
           "revoked"}
_HASHED_PREFIX = "sha256:"
# What the audit log's answers (`kvseal usage`, `kvseal audit`) show for requests made without a
# tenant (refused before their key was read): a tenant of that name would share their rows.
_RESERVED_TENANT_NAMES = ("-",)
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
# The longest tenant name, in characters: the keys file's and the admin routes' one bound (a name
# the file may hold must be one `forget-cache` takes, or a removed name's cache could not be
# forgotten on demand after a frontend restart).
MAX_TENANT_NAME_CHARS = 256
# The concurrency cap of a tenant whose entry sets none, in sequences (a request with n choices
# takes n). A quarter of the engine's default batch (`--max-num-seqs` 256): one tenant's flood
# queues at the door (429) instead of in the engine, and four tenants at their cap still fit
# one batch together. Set `max_concurrent_requests` in
# the keys file for a tenant that needs more (a benchmark client, a batch job).
DEFAULT_MAX_CONCURRENT_REQUESTS = 64
# The largest limit an entry may set (each of them). Far above any real limit (a trillion tokens a
# minute), and exact as a float: the rate buckets count in floats, and a limit float() cannot hold
# (10**400 written out in digits is valid JSON) would fail every request of its tenant.
MAX_LIMIT = 10**12


@dataclass(frozen=True)
class Tenant:
    name: str
    max_concurrent_requests: int | None = None
    max_tokens: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def describe(self) -> str:
        """For the logs: the name and the limits it has."""
        limits = {"concurrency": self.max_concurrent_requests, "max_tokens": self.max_tokens,
                  "rpm": self.requests_per_minute, "tpm": self.tokens_per_minute}
        set_limits = " ".join(f"{k}={v}" for k, v in limits.items() if v is not None)
        return f"{self.name}({set_limits})" if set_limits else self.name


@dataclass(frozen=True)
class ApiKey:
    """One key of the table, as the server knows it: its digest, never the key."""

    digest: bytes
    tenant: Tenant
    is_admin: bool = False

    @property
    def key_id(self) -> str:
        """How the audit log names the key: the first 12 hex digits of its SHA-256 (of what a
        `sha256:<hex>` entry holds); too short to test guesses of a random key against."""
        return self.digest.hex()[:KEY_ID_HEX_DIGITS]


class ApiKeyTable:
    """Authenticates `Authorization: Bearer KEY`; open (one tenant) when built without keys."""

    def __init__(self, keys: list[ApiKey] | None = None) -> None:
        self._keys = keys
        self._open_key = ApiKey(b"", Tenant(DEFAULT_TENANT), is_admin=True)
        self._tenants_by_name = {k.tenant.name: k.tenant for k in keys or ()}

    @property
    def is_open(self) -> bool:
        return self._keys is None

    @property
    def keys(self) -> list[ApiKey]:
        """The keys that authenticate (revoked ones are not in the table)."""
        return list(self._keys or ())

    @property
    def tenants(self) -> list[Tenant]:
        if self._keys is None:
            return [self._open_key.tenant]
        return sorted(self._tenants_by_name.values(), key=lambda t: t.name)

    def current(self, tenant: Tenant) -> Tenant:
        """`tenant` with the limits the table gives it now (they may have changed since a request
        authenticated); as it was if the table no longer has it."""
        return self._tenants_by_name.get(tenant.name, tenant)

    @classmethod
    def load(cls, path: str | None) -> ApiKeyTable:
        """The table of the keys file at `path` (open without one); `ConfigError` naming what is
        wrong (never a key) when the file cannot be read or parsed."""
        if path is None:
            return cls()
        try:
            raw = json.loads(Path(path).read_text(), object_pairs_hook=_object_without_repeated_names)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read the API keys file {path}: {exc}") from exc
        return cls(_parse_keys(raw, path))

    def identify(self, authorization: str | None) -> ApiKey:
        """The caller's key, or an `ApiError` 401."""
        if self._keys is None:
            return self._open_key
        digest = _bearer_digest(authorization)
        found = None
        # Every digest is compared, in constant time, whichever matches: how long this takes says
        # nothing about which key (or which prefix of a digest) came close.
        for key in self._keys:
            if hmac.compare_digest(key.digest, digest):
                found = key
        if found is None:
            raise errors.invalid_api_key()
        return found

    def holds(self, key: ApiKey) -> bool:
        """Whether `key` still authenticates, for its tenant: a reload may have removed, revoked or
        moved it since a request was authenticated with it."""
        if self._keys is None:
            return True
        return any(k.digest == key.digest and k.tenant.name == key.tenant.name for k in self._keys)

    def authenticate(self, authorization: str | None) -> Tenant:
        """The caller's tenant, or an `ApiError` 401."""
        return self.identify(authorization).tenant

    def authenticate_admin(self, authorization: str | None) -> ApiKey:
        """Pass an admin key (or anyone, without a keys file); else `ApiError` 401, or 403 for a
        valid key without `"admin": true`."""
        key = self.identify(authorization)
        if not key.is_admin:
            raise errors.admin_required()
        return key


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


def _object_without_repeated_names(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refused (ValueError) when a name appears twice in it: `json` keeps the
    last one silently, so a key listed twice (a copy-paste slip) would speak for the tenant of
    its last entry. The message never names the key: it is a secret."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("a name appears twice in one JSON object: an API key listed twice, or a field repeated "
                         "in one entry; keep one")
    return obj


def _parse_keys(raw: Any, path: str) -> list[ApiKey]:
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{path} must be a non-empty JSON object mapping each API key to "
                          f'{{"tenant": NAME, ...}}')
    keys: dict[bytes, ApiKey] = {}
    by_name: dict[str, Tenant] = {}
    for index, (key, entry) in enumerate(raw.items()):
        where = f"{path}, entry {index + 1}"  # never the key itself: it is a secret
        digest = _stored_digest(key, where)
        tenant = _parse_entry(entry, where)
        if by_name.setdefault(tenant.name, tenant) != tenant:
            raise ConfigError(f"{where}: tenant '{tenant.name}' appears with different limits; give every "
                              f"key of a tenant the same limits")
        if digest in keys:
            raise ConfigError(f"{where}: the same key appears twice (once in plain text, once as its sha256 "
                              f"digest); keep one entry")
        if not _flag(entry, "revoked", where):
            keys[digest] = ApiKey(digest, tenant, _flag(entry, "admin", where))
    return list(keys.values())


def _stored_digest(key: Any, where: str) -> bytes:
    """The digest of a plain key, or the digest a `sha256:<hex>` entry holds."""
    if not isinstance(key, str) or not key.strip() or key != key.strip() or " " in key:
        raise ConfigError(f"{where}: an API key must be non-empty and contain no spaces")
    if not key.startswith(_HASHED_PREFIX):
        return _digest(key)
    hex_digest = key.removeprefix(_HASHED_PREFIX)
    if not _HEX_DIGEST.fullmatch(hex_digest):
        raise ConfigError(f'{where}: a hashed key must be "sha256:" and 64 lowercase hex digits (the output of '
                          f"`printf %s KEY | sha256sum`)")
    return bytes.fromhex(hex_digest)


def _flag(entry: dict[str, Any], field: str, where: str) -> bool:
    value = entry.get(field, False)
    if not isinstance(value, bool):
        raise ConfigError(f'{where}: "{field}" must be true or false, got {value!r}')
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
    if len(name) > MAX_TENANT_NAME_CHARS:
        raise ConfigError(f'{where}: "tenant" has {len(name)} characters; at most {MAX_TENANT_NAME_CHARS}')
    if not name.isprintable() or name in _RESERVED_TENANT_NAMES:
        reserved = " or ".join(map(repr, _RESERVED_TENANT_NAMES))
        raise ConfigError(f'{where}: "tenant" must be printable and not {reserved} (what `kvseal usage` and '
                          f"`kvseal audit` show for requests no tenant made), got {name!r}")
    concurrency = _positive(entry, "max_concurrent_requests", where) or DEFAULT_MAX_CONCURRENT_REQUESTS
    return Tenant(name, concurrency, _positive(entry, "max_tokens", where),
                  _positive(entry, "requests_per_minute", where), _positive(entry, "tokens_per_minute", where))


def _positive(entry: dict[str, Any], field: str, where: str) -> int | None:
    value = entry.get(field)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_LIMIT:
        shown = repr(value) if not isinstance(value, int) or value.bit_length() < 64 else \
            f"a {len(str(value))}-digit number"
        raise ConfigError(f'{where}: "{field}" must be an integer from 1 to {MAX_LIMIT:_}, got {shown}')
    return value
