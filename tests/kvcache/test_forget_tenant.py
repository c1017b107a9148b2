"""Forgetting a tenant's prefix cache (I5 across a tenant name removed and added again): every
cached page of the name, in every namespace, goes back to the free list, now or with its last
reader; the name's requests already in the engine never read or publish a page again; requests
that arrive later are a new tenant's; other tenants' caches are untouched; the invariants hold
after every step, and the integrity check catches a forget that leaves the pages cached."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from kvseal import SamplingParams
from kvseal._testing.faults import Fault, inject

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
SYSTEM = list(range(50, 82))  # 32 tokens: 8 full pages of 4
PAGE = 4


def _finish(engine: Any, request_id: str) -> Any:
    for _ in range(500):
        outs = [o for o in engine.step() if o.finished and o.request_id == request_id]
        engine.check_integrity()
        if outs:
            return outs[0]
    raise AssertionError(f"{request_id} did not finish")


def _run(engine: Any, request_id: str, prompt: list[int], tenant: str, params: SamplingParams = GREEDY) -> Any:
    engine.add_request(request_id, prompt, params, tenant=tenant)
    return _finish(engine, request_id)


def _cached(engine: Any, tenant: str) -> list[int]:
    return engine.kv.allocator.cached_pages_of(tenant)


def test_forget_frees_every_namespace_of_the_tenant_and_nothing_else(make_llm: Callable[..., Any]) -> None:
    engine = make_llm().engine
    _run(engine, "a", SYSTEM + [7], "alice")
    _run(engine, "a-salted", SYSTEM + [7], "alice", dataclasses.replace(GREEDY, cache_salt="user-1"))
    _run(engine, "b", SYSTEM + [7], "bob")
    alice_pages, bob_pages = _cached(engine, "alice"), _cached(engine, "bob")
    assert len(alice_pages) >= 2 * (len(SYSTEM) // PAGE) and bob_pages
    free_before = engine.kv.allocator.num_unused_pages

    assert engine.forget_tenant("alice") == len(alice_pages)
    engine.check_integrity()
    assert _cached(engine, "alice") == [] and _cached(engine, "bob") == bob_pages
    assert engine.kv.allocator.num_unused_pages == free_before + len(alice_pages)
    # the name's next request is a new tenant's: no hit, in either namespace; bob still hits his own
    assert _run(engine, "new-a", SYSTEM + [7], "alice").num_cached_tokens == 0
    assert _run(engine, "new-a-salted", SYSTEM + [7], "alice",
                dataclasses.replace(GREEDY, cache_salt="user-1")).num_cached_tokens == 0
    assert _run(engine, "b2", SYSTEM + [8], "bob").num_cached_tokens == len(SYSTEM)
    # and the new tenant caches as any tenant does
    assert _run(engine, "new-a2", SYSTEM + [9], "alice").num_cached_tokens == len(SYSTEM)


def test_forgotten_pages_are_scrubbed_as_evicted_ones(make_llm: Callable[..., Any]) -> None:
    engine = make_llm(kv_scrub="free").engine
    _run(engine, "a", SYSTEM + [7], "alice")
    pages = _cached(engine, "alice")
    scrubbed = engine.kv.num_pages_scrubbed
    engine.forget_tenant("alice")
    assert engine.kv.num_pages_scrubbed == scrubbed + len(pages)
    for tensor in (*engine.kv.pool.k, *engine.kv.pool.v):  # [num_kv_heads, num_pages, page_size, head_dim]
        assert not tensor[:, pages].any()


def test_a_request_running_at_the_forget_never_feeds_the_cache(make_llm: Callable[..., Any]) -> None:
    """alice's request is decoding when her name is forgotten (a reload without abort): the pages
    it reads leave with it, the pages it fills afterwards are never published, and the name's next
    request finds nothing of it."""
    engine = make_llm().engine
    long = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    engine.add_request("old", SYSTEM + [7], long, tenant="alice")
    for _ in range(6):  # the prompt is computed and published, and it decodes
        engine.step()
        engine.check_integrity()
    read_at_forget = set(_cached(engine, "alice"))
    assert read_at_forget and engine.find("old") is not None
    assert engine.forget_tenant("alice") == 0  # every page is read by the running request
    while engine.find("old") is not None:
        engine.step()
        engine.check_integrity()
        assert set(_cached(engine, "alice")) <= read_at_forget, "a request closed to the cache published a page"
    assert _cached(engine, "alice") == []
    assert _run(engine, "new", SYSTEM + [7], "alice").num_cached_tokens == 0


def test_a_request_queued_before_the_forget_neither_reads_nor_publishes(make_llm: Callable[..., Any]) -> None:
    engine = make_llm().engine
    _run(engine, "a", SYSTEM + [7], "alice")
    engine.add_request("queued", SYSTEM + [8], GREEDY, tenant="alice")  # not yet scheduled
    engine.forget_tenant("alice")
    assert _finish(engine, "queued").num_cached_tokens == 0
    assert _cached(engine, "alice") == []


def test_a_request_named_ahead_is_the_old_tenants(make_llm: Callable[..., Any]) -> None:
    """PD: a request the frontend started before the forget may reach prefill only after it; the
    forget names it, and it arrives closed to the cache (it is the old tenant's)."""
    engine = make_llm().engine
    _run(engine, "a", SYSTEM + [7], "alice")
    engine.forget_tenant("alice", ["late"])
    late = _run(engine, "late", SYSTEM + [7], "alice")
    assert late.num_cached_tokens == 0 and _cached(engine, "alice") == []
    assert _run(engine, "new", SYSTEM + [7], "alice").num_cached_tokens == 0


def test_the_integrity_check_catches_a_forget_that_keeps_the_pages(make_llm: Callable[..., Any]) -> None:
    engine = make_llm().engine
    _run(engine, "a", SYSTEM + [7], "alice")
    with inject(Fault.FORGET_KEEPS_CACHE):
        engine.forget_tenant("alice")
    with pytest.raises(AssertionError, match="forgotten tenant"):
        engine.check_integrity()
