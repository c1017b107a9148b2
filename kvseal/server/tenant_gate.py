"""Per-tenant concurrency limit (`max_concurrent_requests`), answered with 429.

A slot is taken before the request is tokenized and given back exactly once, when the
request reaches its terminal state (finished, rejected, aborted or failed).
"""

from __future__ import annotations

from collections import Counter

from kvseal.server import errors
from kvseal.server.auth import Tenant


class TenantGate:
    def __init__(self) -> None:
        self._in_flight: Counter[str] = Counter()

    def acquire(self, tenant: Tenant) -> None:
        """Take a slot or raise an `ApiError` 429."""
        limit = tenant.max_concurrent_requests
        if limit is not None and self._in_flight[tenant.name] >= limit:
            raise errors.concurrency_limit(tenant.name, limit)
        self._in_flight[tenant.name] += 1

    def release(self, tenant: Tenant) -> None:
        assert self._in_flight[tenant.name] > 0, f"release without acquire for tenant {tenant.name}"
        self._in_flight[tenant.name] -= 1
