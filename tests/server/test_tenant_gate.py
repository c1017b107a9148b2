"""The per-tenant concurrency gate's table: slots counted, and no entry left per tenant seen."""

from __future__ import annotations

import pytest

from kvseal.server.auth import Tenant
from kvseal.server.errors import ApiError
from kvseal.server.tenant_gate import TenantGate


def test_a_tenant_at_its_cap_is_refused_until_a_slot_comes_back() -> None:
    gate = TenantGate()
    alice = Tenant("alice", max_concurrent_requests=2)
    gate.acquire(alice, 2)
    with pytest.raises(ApiError) as info:
        gate.acquire(alice)
    assert info.value.status == 429
    gate.release(alice)
    gate.acquire(alice)


def test_tenants_with_nothing_in_flight_leave_no_entry() -> None:
    gate = TenantGate()
    for i in range(100):  # tenants come and go with key reloads
        tenant = Tenant(f"tenant-{i}", max_concurrent_requests=4)
        gate.acquire(tenant, 3)
        gate.release(tenant, 2)
        gate.release(tenant)
    kept = Tenant("kept", max_concurrent_requests=4)
    gate.acquire(kept)
    assert gate.num_tenants_in_flight() == 1
    gate.release(kept)
    assert gate.num_tenants_in_flight() == 0
