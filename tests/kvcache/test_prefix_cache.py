"""The per-tenant prefix cache (I3, I4, I5, I7): hits within a tenant, never across tenants,
shared pages read-only and reference counted, LRU eviction with scrub/poison at eviction,
preemption and aborts leave it consistent, greedy outputs equal the cache switched off."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvseal import FinishReason, SamplingParams
from kvseal._testing.faults import Fault, inject
from kvseal.kvcache.prefix_cache import extend_page_hashes, namespace_of
from kvseal.types import ISOLATION_CHECK_FAILED

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
SYSTEM = list(range(50, 82))  # 32 tokens: 8 full pages of 4
PAGE = 4


def _run(engine: Any, request_id: str, prompt: list[int], tenant: str,
         params: SamplingParams = GREEDY) -> Any:
    engine.add_request(request_id, prompt, params, tenant=tenant)
    final = None
    for _ in range(500):
        for out in engine.step():
            if out.finished and out.request_id == request_id:
                final = out
        engine.check_integrity()
        if final is not None:
            return final
    raise AssertionError(f"{request_id} did not finish")


def test_same_tenant_hits_and_prefills_only_the_rest(make_llm: Callable[..., Any]) -> None:
    engine = make_llm().engine
    first = _run(engine, "a1", SYSTEM + [7, 8, 9], "alice")
    assert first.num_cached_tokens == 0
    second = _run(engine, "a2", SYSTEM + [10, 11], "alice")
    assert second.num_cached_tokens == len(SYSTEM)
    assert second.error is None and second.finish_reason is FinishReason.LENGTH


def test_another_tenant_never_hits(make_llm: Callable[..., Any]) -> None:
    engine = make_llm().engine
    _run(engine, "a", SYSTEM + [7], "alice")
    out = _run(engine, "b", SYSTEM + [7], "bob")
    assert out.num_cached_tokens == 0 and out.error is None


def test_a_cache_salt_splits_its_tenants_cache_and_never_joins_anothers(make_llm: Callable[..., Any]) -> None:
    """vLLM's cache_salt: a tenant's requests with one salt share pages, with another salt (or
    none) they do not; another tenant with the same salt still never hits (I5)."""
    engine = make_llm().engine
    salted = dataclasses.replace(GREEDY, cache_salt="user-1")
    _run(engine, "s1", SYSTEM + [7], "alice", salted)
    assert _run(engine, "s2", SYSTEM + [8], "alice", salted).num_cached_tokens == len(SYSTEM)
    assert _run(engine, "other-salt", SYSTEM + [8], "alice",
                dataclasses.replace(GREEDY, cache_salt="user-2")).num_cached_tokens == 0
    assert _run(engine, "no-salt", SYSTEM + [9], "alice").num_cached_tokens == 0
    assert _run(engine, "bob-same-salt", SYSTEM + [8], "bob", salted).num_cached_tokens == 0
    others = (namespace_of("alice"), namespace_of("alice", "y"), namespace_of("bob", "x"))
    assert namespace_of("alice", "x") not in others
    # framed: the salt cannot be moved into the tenant's name, or the tenant's name into the salt
    assert namespace_of("ab", "c") != namespace_of("a", "bc")
    assert namespace_of("a\x01salt", None) != namespace_of("a", "")


def _cross_tenant_cached_tokens(make_llm: Callable[..., Any], *faults: Fault) -> Any:
    """bob sends alice's exact prompt after her; returns bob's final output (faults on throughout)."""
    engine = make_llm().engine
    with _faults(*faults):
        _run(engine, "a", SYSTEM + [7], "alice")
        engine.add_request("b", SYSTEM + [7], GREEDY, tenant="bob")
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    return out
    raise AssertionError("bob's request did not finish")


def _faults(*faults: Fault) -> Any:
    import contextlib

    stack = contextlib.ExitStack()
    for fault in faults:
        stack.enter_context(inject(fault))
    return stack


def test_dropping_the_namespace_makes_the_cross_tenant_check_fail(make_llm: Callable[..., Any]) -> None:
    """The cross-tenant check (bob's cached_tokens == 0) can fail: with the namespace dropped
    from the key and the KV checks bypassed, bob is served alice's pages."""
    assert _cross_tenant_cached_tokens(make_llm).num_cached_tokens == 0
    leaked = _cross_tenant_cached_tokens(make_llm, Fault.DROP_CACHE_NAMESPACE, Fault.BYPASS_KV_CHECKS)
    assert leaked.num_cached_tokens == len(SYSTEM), "the check must detect the cross-tenant hit"
    assert leaked.error is None


def test_the_ownership_check_refuses_a_cached_page_of_another_namespace(make_llm: Callable[..., Any]) -> None:
    """With the namespace dropped from the key but the checks on, bob's forward is refused
    before it reads alice's cached page (I3: a shared page must be of the reader's namespace)."""
    out = _cross_tenant_cached_tokens(make_llm, Fault.DROP_CACHE_NAMESPACE)
    assert out.finish_reason is FinishReason.ABORT and out.error_code == ISOLATION_CHECK_FAILED
    assert "does not own" in out.error


def test_at_least_the_last_token_is_computed(make_llm: Callable[..., Any]) -> None:
    """A prompt of whole pages hits all but its last page: the reuse boundary is page-aligned
    and the last prompt token must be computed to sample from."""
    engine = make_llm().engine
    _run(engine, "a1", SYSTEM, "alice")
    out = _run(engine, "a2", SYSTEM, "alice")
    assert out.num_cached_tokens == len(SYSTEM) - PAGE


def test_output_pages_are_published_for_multi_turn(make_llm: Callable[..., Any]) -> None:
    engine = make_llm().engine
    params = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)
    first = _run(engine, "t1", SYSTEM, "alice", params)
    history = SYSTEM + first.token_ids
    second = _run(engine, "t2", history + [3, 4], "alice")
    assert second.num_cached_tokens == (len(history) - 1) // PAGE * PAGE > len(SYSTEM)


def test_greedy_outputs_equal_with_the_cache_off(make_llm: Callable[..., Any]) -> None:
    prompts = [SYSTEM + [7, 8, 9], SYSTEM + [10], SYSTEM[:13] + [1, 2], SYSTEM + [7, 8, 9, 4, 5, 6, 7, 8, 9]]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    on = make_llm(max_num_batched_tokens=8).generate(prompts, params)
    off = make_llm(max_num_batched_tokens=8, enable_prefix_caching=False).generate(prompts, params)
    again = make_llm(max_num_batched_tokens=8)
    again.generate(prompts, params)  # warm: every prompt now hits
    hits = again.generate(prompts, params)
    assert [o.token_ids for o in on] == [o.token_ids for o in off] == [o.token_ids for o in hits]
    assert all(o.num_cached_tokens > 0 for o in hits)
    assert all(o.num_cached_tokens == 0 for o in off)


def test_shared_pages_are_reference_counted_and_never_written_by_a_reader(make_llm: Callable[..., Any]) -> None:
    engine = make_llm().engine
    _run(engine, "warm", SYSTEM + [1], "alice")
    for name in ("r1", "r2"):
        engine.add_request(name, SYSTEM + [2, 3], SamplingParams(max_tokens=20, ignore_eos=True), tenant="alice")
    engine.step()
    kv = engine.kv
    shared = kv.allocator.pages_of("r1")[:len(SYSTEM) // PAGE]
    assert shared == kv.allocator.pages_of("r2")[:len(SYSTEM) // PAGE]
    assert all(kv.allocator.cached_page(p).num_readers == 2 for p in shared)  # type: ignore[union-attr]
    for name in ("r1", "r2"):
        assert set(shared).isdisjoint(kv.allocator.own_pages_of(name))
        written = kv.slots(name, len(SYSTEM), len(SYSTEM) + 2).div(PAGE, rounding_mode="floor")
        assert set(written.tolist()).isdisjoint(shared), "a reader writes only its own pages"
    engine.abort("r1")
    assert all(kv.allocator.cached_page(p).num_readers == 1 for p in shared)  # type: ignore[union-attr]
    engine.check_integrity()
    engine.abort("r2")
    assert all(kv.allocator.cached_page(p).num_readers == 0 for p in shared)  # type: ignore[union-attr]
    assert kv.num_free_pages == kv.allocator.num_pages
    engine.check_integrity()


def test_cached_pages_keep_their_kv_and_eviction_poisons_them(make_llm: Callable[..., Any]) -> None:
    """Scrub and poison (I7) apply at eviction, not when a page goes into the cache."""
    engine = make_llm(check_kv=True).engine
    kv = engine.kv
    _run(engine, "a", SYSTEM + [1], "alice")
    cached = sorted(kv.allocator.cached_namespaces())
    assert len(cached) >= len(SYSTEM) // PAGE
    k, v = kv.pool.read_pages(0, torch.tensor(cached))
    assert not torch.isnan(k).any() and not torch.isnan(v).any(), "a page released into the cache keeps its KV"
    evicted = kv.evict(2)
    assert len(evicted) == 2 and all(kv.allocator.cached_page(p) is None for p in evicted)
    for layer in range(len(kv.pool.k)):
        k, v = kv.pool.read_pages(layer, torch.tensor(evicted))
        assert torch.isnan(k).all() and torch.isnan(v).all()
    engine.check_integrity()


def test_eviction_is_least_recently_used(make_llm: Callable[..., Any]) -> None:
    engine = make_llm(kv_cache_tokens=64, max_model_len=64).engine
    one = SamplingParams(max_tokens=1)
    old, new = list(range(100, 117)), list(range(300, 317))
    _run(engine, "old", old, "alice", one)
    _run(engine, "new", new, "alice", one)
    _run(engine, "touch", old, "alice", one)  # 'old' is now the more recently used prefix
    _run(engine, "big", list(range(400, 440)), "bob", one)  # needs 2 pages more than are free
    assert _run(engine, "old again", old, "alice", one).num_cached_tokens == 16
    assert _run(engine, "new again", new, "alice", one).num_cached_tokens < 16
    engine.check_integrity()


def test_tenants_that_come_and_go_leave_no_namespace_in_the_records(make_llm: Callable[..., Any]) -> None:
    """The write records name a namespace only while a row or a cached page carries it; one
    that comes back gets a new id, so its pages can never match a row of an earlier one."""
    engine = make_llm(kv_cache_tokens=64, max_model_len=64).engine
    one = SamplingParams(max_tokens=1)
    prompt = list(range(100, 117))  # 4 full pages published per tenant; 16 pages in the pool
    for i in range(12):
        _run(engine, f"r{i}", prompt, f"tenant-{i}", one)  # later tenants' pages evict earlier ones'
    records = engine.kv.records
    assert records.num_namespaces() == len(set(engine.kv.allocator.cached_namespaces().values()))
    assert records.num_namespaces() <= 4
    engine.kv.evict(len(engine.kv.allocator.cached_namespaces()))
    engine.check_integrity()
    assert records.num_namespaces() == 0
    assert _run(engine, "back", prompt, "tenant-0", one).num_cached_tokens == 0
    assert _run(engine, "back again", prompt, "tenant-0", one).num_cached_tokens == 16


def test_a_preempted_request_resumes_from_its_own_published_pages(make_llm: Callable[..., Any]) -> None:
    engine = make_llm(kv_cache_tokens=48, max_model_len=48, max_num_batched_tokens=64).engine
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", list(range(10 * i, 10 * i + 24)), params, tenant="alice")
    outputs = {}
    while engine.has_unfinished():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_integrity()
    assert engine.stats().num_preemptions > 0
    assert all(o.error is None for o in outputs.values())
    reference = make_llm(enable_prefix_caching=False).generate(
        [list(range(10 * i, 10 * i + 24)) for i in range(3)], params)
    assert [outputs[f"r{i}"].token_ids for i in range(3)] == [o.token_ids for o in reference]


def test_integrity_check_catches_a_wrong_reader_count(make_llm: Callable[..., Any]) -> None:
    engine = make_llm().engine
    _run(engine, "a", SYSTEM + [1], "alice")
    page = next(iter(engine.kv.allocator.cached_namespaces()))
    engine.kv.allocator.cached_page(page).num_readers += 1  # type: ignore[union-attr]
    with pytest.raises(AssertionError, match="reader count"):
        engine.check_integrity()


def test_page_hashes_chain_every_earlier_token() -> None:
    a: list[bytes] = []
    b: list[bytes] = []
    extend_page_hashes(a, [1, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    extend_page_hashes(b, [9, 2, 3, 4, 5, 6, 7, 8], 4, 2)
    assert a[1] != b[1], "page 1 has the same tokens but a different prefix"
    assert namespace_of("ab") != namespace_of("a")


def test_no_prefix_caching_flag_turns_it_off() -> None:
    import argparse

    from kvseal.engine_args import add_engine_arguments, engine_args_from

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_args_from(parser.parse_args([])).enable_prefix_caching
    assert not engine_args_from(parser.parse_args(["--no-prefix-caching"])).enable_prefix_caching
    assert not engine_args_from(parser.parse_args(["--no-enable-prefix-caching"])).enable_prefix_caching  # vLLM's
    assert engine_args_from(parser.parse_args(["--block-size", "32"])).page_size == 32  # vLLM's name too


# ---- a prefix being computed is waited for, not computed twice (own tenant only) ----------------

BUDGET = 128  # a step's budget takes several whole prompts: without the wait, they would all run at once

def _run_together(engine: Any, requests: list[tuple[str, list[int], str]]) -> dict[str, Any]:
    for request_id, prompt, tenant in requests:
        engine.add_request(request_id, prompt, GREEDY, tenant=tenant)
    finals: dict[str, Any] = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.check_integrity()
        if len(finals) == len(requests):
            return finals
    raise AssertionError(f"only {sorted(finals)} finished")


def test_the_same_prompt_sent_together_is_prefilled_once(make_llm: Callable[..., Any]) -> None:
    """The `n` choices of one request arrive as requests with one prompt: the first computes it,
    the others start once its pages are published and compute only the last token."""
    engine = make_llm(max_num_batched_tokens=BUDGET).engine
    prompt = SYSTEM + [7, 8, 9]
    finals = _run_together(engine, [(f"a{i}", prompt, "alice") for i in range(3)])
    assert [finals[f"a{i}"].num_cached_tokens for i in range(3)] == [0, len(SYSTEM), len(SYSTEM)]
    alone = make_llm(enable_prefix_caching=False).generate([prompt], GREEDY)[0]
    assert all(out.token_ids == alone.token_ids and out.error is None for out in finals.values())


def _first_step_computes(engine: Any, first: tuple[str, str], second: tuple[str, str]) -> int:
    """Two requests of SYSTEM + [7] added together; how many tokens the second computes in step 1."""
    for request_id, tenant in (first, second):
        engine.add_request(request_id, SYSTEM + [7], GREEDY, tenant=tenant)
    engine.step()
    return int(engine.find(second[0]).num_computed_tokens)


def test_another_tenants_prefill_is_never_waited_for(make_llm: Callable[..., Any]) -> None:
    """bob's start cannot depend on what alice is computing (I5): he computes beside her, while
    alice's own second request waits for her first. Shown to fail with the namespace dropped
    from the cache keys (test-only fault): bob then waits on alice's prefill."""
    assert _first_step_computes(make_llm(max_num_batched_tokens=BUDGET).engine, ("a", "alice"), ("b", "bob")) > 0
    assert _first_step_computes(make_llm(max_num_batched_tokens=BUDGET).engine, ("a", "alice"), ("a2", "alice")) == 0
    with _faults(Fault.DROP_CACHE_NAMESPACE):
        assert _first_step_computes(make_llm(max_num_batched_tokens=BUDGET).engine, ("a", "alice"), ("b", "bob")) == 0


def test_a_request_waiting_on_a_prefill_that_ends_starts_at_once(make_llm: Callable[..., Any]) -> None:
    engine = make_llm(max_num_batched_tokens=BUDGET).engine
    assert _first_step_computes(engine, ("a1", "alice"), ("a2", "alice")) == 0
    engine.abort("a1")
    engine.step()
    assert engine.find("a2").num_computed_tokens > 0, "nothing it waited on is running"
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
