"""Operator actions on a running server: reload the API keys, and the model's kill switch.

    POST /admin/keys/reload[?abort=true]        re-read --api-keys (SIGHUP does the same, without abort)
    POST /admin/models/{id}/disable[?abort=true] new requests for the model get 503 model_disabled
    POST /admin/models/{id}/enable
    POST /admin/tenants/{name}/forget-cache     every engine drops the tenant's prefix cache

Each needs an admin key (an entry with `"admin": true` in the keys file; open without a keys
file, as /metrics is): 401 without a valid key, 403 for a tenant's key. None takes a body or a
query parameter it does not use (400: never silently ignored), and none answers a request a
browser sends on a page's behalf (403; `admin_caller`). The answers and errors are JSON in
OpenAI's shape.

A reload replaces the whole table at once: an added key works for the next request, a removed
or revoked one is refused (401) from the next request on, and one moved to another tenant speaks
for that tenant from the next request on. Requests already in flight with a key no longer in the
table, or no longer for their tenant, finish, unless `abort=true`: then each ends with 401 `api_key_revoked`
(an error event in a stream) and is audited with that reason. A file that does not parse is
refused whole with the reason (400 `invalid_keys_file`, or a log line for SIGHUP) and the old
table stays. Limits (concurrency, max_tokens, rates) change with the table, for the next request.
A removed tenant's `/metrics` series go with it, and rate buckets that have refilled are dropped.
A tenant name none of whose keys is left (removed, or every key replaced by new ones in one
reload: the new keys may be another customer's) has its prefix cache forgotten by every engine
(`ForgetTenantMsg`) before any request of the new table reaches one: a key added under the name
later starts with an empty cache, and the name's requests still in flight neither read nor feed
the cache any more (I5). Audit records and usage stay keyed by the name: the name is the
operator's identity for records. `forget-cache` does the same for one name on demand.

Disabling the model lets in-flight requests finish, or with `abort=true` ends them with 503
`model_disabled`. Every action, a refused reload included, is one `AdminRecord` in the audit log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvseal._testing.faults import Fault, is_active
from kvseal.errors import ConfigError
from kvseal.messages.msgs import ABORT_KEY_REVOKED, ABORT_MODEL_DISABLED
from kvseal.server import errors
from kvseal.server.audit import AdminAction, AdminRecord
from kvseal.server.auth import MAX_TENANT_NAME_CHARS, ApiKey, ApiKeyTable, authorization_of
from kvseal.server.errors import ApiError
from kvseal.server.state import AppState, LiveCall

logger = logging.getLogger("kvseal.server")

Trigger = Literal["http", "sighup"]


@dataclass(frozen=True)
class KeysChange:
    """What a reload changed, keys named by `ApiKey.key_id`. A key that now speaks for another
    tenant is neither added nor removed but moved: its requests no longer act for the tenant
    they started as (`ApiKeyTable.holds`), which the operator must see."""

    keys_added: list[str]
    keys_removed: list[str]
    keys_moved: list[dict[str, str]]  # {"key_id", "from_tenant", "to_tenant"}
    tenants_changed: list[str]  # tenants whose limits differ (added and removed tenants too)
    # tenants none of whose keys speaks for them any more: their prefix cache is forgotten
    tenants_forgotten: list[str]

    @classmethod
    def between(cls, old: ApiKeyTable, new: ApiKeyTable) -> KeysChange:
        old_keys = {k.digest: k for k in old.keys}
        new_keys = {k.digest: k for k in new.keys}
        old_tenants = {t.name: t for t in old.tenants}
        new_tenants = {t.name: t for t in new.tenants}
        changed = sorted(n for n in old_tenants.keys() | new_tenants.keys() if old_tenants.get(n) != new_tenants.get(n))
        moved = sorted(({"key_id": k.key_id, "from_tenant": old_keys[d].tenant.name, "to_tenant": k.tenant.name}
                        for d, k in new_keys.items() if d in old_keys and old_keys[d].tenant.name != k.tenant.name),
                       key=lambda m: m["key_id"])
        return cls(sorted(k.key_id for d, k in new_keys.items() if d not in old_keys),
                   sorted(k.key_id for d, k in old_keys.items() if d not in new_keys), moved, changed,
                   _tenants_without_old_keys(old, new))


def _tenants_without_old_keys(old: ApiKeyTable, new: ApiKeyTable) -> list[str]:
    """Tenant names that had keys in `old` none of which speaks for the name in `new`: removed,
    or every key replaced at once. Whoever holds the name's keys now may be another customer."""
    def keys_by_tenant(table: ApiKeyTable) -> dict[str, set[bytes]]:
        by_name: dict[str, set[bytes]] = {}
        for key in table.keys:
            by_name.setdefault(key.tenant.name, set()).add(key.digest)
        return by_name

    before, after = keys_by_tenant(old), keys_by_tenant(new)
    return sorted(name for name, digests in before.items() if not digests & after.get(name, set()))


def forget_tenant_cache(state: AppState, tenants: list[str], reason: str) -> int:
    """Have every engine forget each tenant's prefix cache; the engines told at once."""
    num_told = 0
    for tenant in tenants:
        num_told = max(num_told, state.engine.forget_tenant(tenant))
    state.metrics.tenant_cache_forgets.labels(reason=reason).inc(len(tenants))
    return num_told


def reload_keys(state: AppState, trigger: Trigger, by: ApiKey | None, *, abort: bool) -> dict[str, Any]:
    """Replace the key table with the file's; `ApiError` 400 (and the old table kept) when the
    file cannot be read or parsed. With `abort`, end the in-flight requests of keys no longer in
    the table."""
    path = state.config.api_keys_path
    if path is None:
        raise errors.no_keys_file()
    try:
        table = ApiKeyTable.load(path)
    except ConfigError as exc:
        logger.error("the API keys file was not reloaded (%s); the keys in use are unchanged", exc)
        _audit(state, "keys_reload_refused", trigger, by, reason=str(exc))
        raise errors.invalid_keys_file(str(exc)) from exc
    if is_active(Fault.KEEP_REVOKED_KEYS):  # test-only: removed keys stay valid
        kept = {k.digest for k in table.keys}
        table = ApiKeyTable(table.keys + [k for k in state.keys.keys if k.digest not in kept])
    if not any(k.is_admin for k in table.keys):
        logger.warning("the reloaded keys file has no admin key: /admin and /metrics now refuse every key; SIGHUP "
                       "still reloads the file")
    change = KeysChange.between(state.keys, table)
    state.keys = table
    # in the same synchronous call as the swap: nothing submitted under the new table precedes it
    num_told = forget_tenant_cache(state, change.tenants_forgotten, "tenant_removed")
    state.metrics.forget_tenants({t.name for t in table.tenants})
    state.rates.follow(table.tenants)
    num_aborted = _stop_calls(state, lambda c: not _still_holds(table, c), ABORT_KEY_REVOKED) if abort else 0
    logger.warning("API keys reloaded from %s (%s): %d keys, %d added, %d removed, %d moved to another tenant, %d "
                   "in-flight requests aborted; tenants now [%s], changed %s, prefix cache forgotten for %s", path,
                   trigger, len(table.keys), len(change.keys_added), len(change.keys_removed), len(change.keys_moved),
                   num_aborted, ", ".join(t.describe() for t in table.tenants), change.tenants_changed,
                   change.tenants_forgotten)
    forgotten = change.tenants_forgotten
    _audit(state, "keys_reloaded", trigger, by, keys_added=change.keys_added, keys_removed=change.keys_removed,
           keys_moved=change.keys_moved, tenants_changed=change.tenants_changed, num_aborted=num_aborted,
           tenants_forgotten=forgotten or None, num_engines_told=num_told if forgotten else None)
    return {"object": "keys.reload", "num_keys": len(table.keys), "tenants": [t.name for t in table.tenants],
            "keys_added": change.keys_added, "keys_removed": change.keys_removed, "keys_moved": change.keys_moved,
            "tenants_changed": change.tenants_changed, "tenants_forgotten": forgotten, "num_aborted": num_aborted}


def _still_holds(table: ApiKeyTable, call: LiveCall) -> bool:
    """Whether the call's key still speaks for the tenant the call runs as: a key removed,
    revoked or moved to another tenant does not (as `ApiKeyTable.holds` judges a request not yet
    submitted)."""
    tenant = call.tenant.name if call.tenant is not None else None
    return any(k.digest == call.key_digest and k.tenant.name == tenant for k in table.keys)


def reload_keys_on_signal(state: AppState) -> None:
    """SIGHUP: reload without aborting; a refused file is logged (and audited), never raised."""
    try:
        reload_keys(state, "sighup", None, abort=False)
    except ApiError as err:
        logger.error("SIGHUP: %s", err.message)


def set_model_disabled(state: AppState, model: str, is_disabled: bool, by: ApiKey | None, *,
                       abort: bool) -> dict[str, Any]:
    """The kill switch; `ApiError` 404 for a model this server does not serve."""
    if model != state.model_name:
        raise errors.model_not_found(model, state.model_name)
    if is_disabled:
        state.disabled_models.add(model)
    else:
        state.disabled_models.discard(model)
    num_aborted = _stop_calls(state, lambda c: True, ABORT_MODEL_DISABLED) if is_disabled and abort else 0
    action: AdminAction = "model_disabled" if is_disabled else "model_enabled"
    logger.warning("%s: %s by the operator; %d in-flight requests aborted", action, model, num_aborted)
    _audit(state, action, "http", by, model=model, num_aborted=num_aborted if is_disabled else None)
    return {"id": model, "object": "model", "disabled": is_disabled, "num_aborted": num_aborted}


def forget_cache_on_request(state: AppState, tenant: str, by: ApiKey | None) -> dict[str, Any]:
    """`POST /admin/tenants/{name}/forget-cache`: any name, in the table or not (a name another
    frontend, or an earlier keys file, served)."""
    if not tenant or len(tenant) > MAX_TENANT_NAME_CHARS:
        raise errors.invalid_tenant_name(len(tenant), MAX_TENANT_NAME_CHARS)
    num_told = forget_tenant_cache(state, [tenant], "operator")
    logger.warning("prefix cache of tenant %r forgotten on the operator's request (%d engines told now)", tenant,
                   num_told)
    _audit(state, "tenant_cache_forgotten", "http", by, tenants_forgotten=[tenant], num_engines_told=num_told)
    return {"object": "tenant.cache_forgotten", "tenant": tenant, "num_engines_told": num_told}


def _stop_calls(state: AppState, matches: Callable[[LiveCall], bool], reason: str) -> int:
    calls = [c for c in state.live_calls.values() if matches(c)]
    for call in calls:
        call.stop(reason)
    return len(calls)


def _audit(state: AppState, action: AdminAction, trigger: Trigger, by: ApiKey | None, **fields: Any) -> None:
    by_tenant = by.tenant.name if by is not None and by.digest else None
    by_key_id = by.key_id if by is not None and by.digest else None
    state.audit.write(AdminRecord(action, time.time(), trigger, by_tenant, by_key_id, **fields))


def admin_caller(state: AppState, request: Request, params: tuple[str, ...] = ()) -> ApiKey:
    """The admin key behind a request, after the checks every admin route makes, in this order:
    not sent by a browser on a page's behalf (403: without a keys file the routes are open, and a
    page could otherwise post to them with no preflight), an admin key (401/403), no body (400:
    options are query parameters, none ignored), no query parameter but `params` (400)."""
    if "origin" in request.headers or request.headers.get("sec-fetch-site", "none") != "none":
        raise errors.browser_request_refused()
    by = state.keys.authenticate_admin(authorization_of(request.headers))
    if request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers:
        raise errors.admin_body_refused()
    unknown = sorted(set(request.query_params) - set(params))
    if unknown:
        raise errors.admin_params_refused(unknown, list(params))
    return by


def add_admin_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/admin/keys/reload", response_model=None)
    async def reload(request: Request) -> Response:
        try:
            by = admin_caller(state, request, ("abort",))
            return JSONResponse(reload_keys(state, "http", by, abort=_abort_param(request)))
        except ApiError as err:
            return errors.response(err)

    @app.post("/admin/tenants/{tenant:path}/forget-cache", response_model=None)
    async def forget_cache(tenant: str, request: Request) -> Response:
        try:
            by = admin_caller(state, request)
            return JSONResponse(forget_cache_on_request(state, tenant, by))
        except ApiError as err:
            return errors.response(err)

    @app.post("/admin/models/{model:path}/disable", response_model=None)
    async def disable(model: str, request: Request) -> Response:
        return _switch(state, request, model, is_disabled=True)

    @app.post("/admin/models/{model:path}/enable", response_model=None)
    async def enable(model: str, request: Request) -> Response:
        return _switch(state, request, model, is_disabled=False)


def _switch(state: AppState, request: Request, model: str, *, is_disabled: bool) -> Response:
    try:
        by = admin_caller(state, request, ("abort",))
        abort = _abort_param(request)
        if abort and not is_disabled:
            raise errors.abort_only_on_disable()
        return JSONResponse(set_model_disabled(state, model, is_disabled, by, abort=abort))
    except ApiError as err:
        return errors.response(err)


def _abort_param(request: Request) -> bool:
    values = request.query_params.getlist("abort")
    if len(values) > 1:
        raise errors.repeated_abort_param(len(values))
    value = values[0] if values else "false"
    if value.lower() in ("true", "1"):
        return True
    if value.lower() in ("false", "0"):
        return False
    raise errors.invalid_abort_param(value)
