"""Per-tenant concurrency limit (`max_concurrent_requests`), answered with 429.

A request takes one slot per sequence it puts in the engine (`n`): a request with 16 choices
is 16 requests there, and a cap that counted it as one would let a tenant at its cap fill
the engine's whole batch. The slots are taken before the request is tokenized and given back
exactly once, when the request reaches its terminal state (finished, rejected, aborted or
failed). Only tenants with a request in flight are counted: a tenant whose last slot comes back
is forgotten, so the table holds no entry per tenant ever seen (keys are reloaded, tenants come
and go).
"""

from __future__ import annotations

from collections import Counter

from kvseal.server import errors
from kvseal.server.auth import Tenant


class TenantGate:
    def __init__(self) -> None:
        self._in_flight: Counter[str] = Counter()

    def acquire(self, tenant: Tenant, num_slots: int = 1) -> None:
        """Take `num_slots` slots or raise an `ApiError` 429 (one that retrying cannot help when
        the request alone is over the limit)."""
        limit = tenant.max_concurrent_requests
        if limit is not None:
            if num_slots > limit:
                raise errors.concurrency_limit_never(tenant.name, limit, num_slots)
            if self._in_flight[tenant.name] + num_slots > limit:
                raise errors.concurrency_limit(tenant.name, limit, num_slots)
        self._in_flight[tenant.name] += num_slots

    def release(self, tenant: Tenant, num_slots: int = 1) -> None:
        assert self._in_flight[tenant.name] >= num_slots, f"release without acquire for tenant {tenant.name}"
        self._in_flight[tenant.name] -= num_slots
        if not self._in_flight[tenant.name]:
            del self._in_flight[tenant.name]

    def num_tenants_in_flight(self) -> int:
        """Tenants holding at least one slot (the table's size)."""
        return len(self._in_flight)
