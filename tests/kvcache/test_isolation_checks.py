"""I4 and I7: checked mode catches reads of unwritten slots; scrub modes wipe freed pages.

The fault switch reproduces the incident's placeholder path: a prompt's prefill is replaced
by one token while the request is counted as fully prefilled. Without checks, the request
then decodes over whatever the pages held before: another tenant's KV.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvseal import FinishReason, SamplingParams
from kvseal._testing.faults import Fault, inject

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
VICTIM_PROMPT = list(range(10, 40))
SECRET_A = list(range(300, 330))
SECRET_B = list(range(400, 430))


def _after_secret(llm: Any, secret: list[int], fault: bool) -> Any:
    llm.generate([secret], GREEDY, tenant="alice")
    if not fault:
        return llm.generate([VICTIM_PROMPT], GREEDY, tenant="bob")[0]
    with inject(Fault.PLACEHOLDER_PREFILL):
        return llm.generate([VICTIM_PROMPT], GREEDY, tenant="bob")[0]


def test_placeholder_fault_leaks_without_checks(make_llm: Callable[..., Any]) -> None:
    """The fault is real: bob's output depends on what alice sent before him."""
    out_a = _after_secret(make_llm(), SECRET_A, fault=True)
    out_b = _after_secret(make_llm(), SECRET_B, fault=True)
    assert out_a.finish_reason is FinishReason.LENGTH
    assert out_a.token_ids != out_b.token_ids
    clean_a = _after_secret(make_llm(), SECRET_A, fault=False)
    clean_b = _after_secret(make_llm(), SECRET_B, fault=False)
    assert clean_a.token_ids == clean_b.token_ids


def test_checked_mode_catches_the_placeholder_fault(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(check_kv=True)
    out = _after_secret(llm, SECRET_A, fault=True)
    assert out.finish_reason is FinishReason.ABORT
    assert out.error and "isolation check failed" in out.error and "never wrote" in out.error
    assert out.token_ids == []
    llm.engine.check_integrity()
    assert llm.engine.kv.num_used_pages == 0
    # The engine keeps serving correctly after refusing the bad forward.
    healthy = _after_secret(llm, SECRET_A, fault=False).token_ids
    assert healthy == _after_secret(make_llm(), SECRET_B, fault=False).token_ids


def test_scrub_free_removes_the_dependency_on_earlier_tenants(make_llm: Callable[..., Any]) -> None:
    out_a = _after_secret(make_llm(kv_scrub="free"), SECRET_A, fault=True)
    out_b = _after_secret(make_llm(kv_scrub="free"), SECRET_B, fault=True)
    assert out_a.token_ids == out_b.token_ids


def _pages_after_one_request(llm: Any) -> list[int]:
    engine = llm.engine
    engine.add_request("r", SECRET_A, GREEDY, tenant="alice")
    engine.step()
    pages = engine.kv.allocator.pages_of("r")
    while engine.has_unfinished():
        engine.step()
    return pages


def test_checked_mode_poisons_freed_pages_with_nan(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(check_kv=True)
    pages = _pages_after_one_request(llm)
    pool = llm.engine.kv.pool
    for layer in range(len(pool.k)):
        k, v = pool.read_pages(layer, torch.tensor(pages))
        assert torch.isnan(k).all() and torch.isnan(v).all()


def test_scrub_free_zeroes_pages_on_free(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(kv_scrub="free")
    pages = _pages_after_one_request(llm)
    pool = llm.engine.kv.pool
    assert (pool.read_pages(0, torch.tensor(pages))[0] == 0).all()
    assert (pool.read_pages(1, torch.tensor(pages))[1] == 0).all()


def test_scrub_alloc_zeroes_pages_when_handed_out(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(kv_scrub="alloc")
    pages = _pages_after_one_request(llm)
    kv = llm.engine.kv
    assert (kv.pool.read_pages(0, torch.tensor(pages))[0] != 0).any(), "scrub=alloc keeps data until reuse"
    kv.reserve("next", "bob", len(pages) * kv.page_size)
    assert kv.allocator.pages_of("next") == pages
    k, v = kv.pool.read_pages(0, torch.tensor(pages))
    assert (k == 0).all() and (v == 0).all()
    assert kv.num_written_tokens("next") == 0


def test_written_records_follow_ownership(make_llm: Callable[..., Any]) -> None:
    """A slot written under one owner never counts as written for the next owner."""
    llm = make_llm()
    engine = llm.engine
    engine.add_request("a", SECRET_A, SamplingParams(max_tokens=2, ignore_eos=True), tenant="alice")
    engine.step()
    assert engine.kv.num_written_tokens("a") == len(SECRET_A)
    pages = engine.kv.allocator.pages_of("a")
    engine.abort("a")
    engine.kv.reserve("b", "bob", len(SECRET_A))
    assert engine.kv.allocator.pages_of("b") == pages
    assert engine.kv.num_written_tokens("b") == 0


def _bob_beside_alice(llm: Any, bob_prompt: list[int], fault: bool) -> Any:
    """alice is mid-generation (her pages are live) when bob arrives; optionally with the fault."""
    engine = llm.engine
    engine.add_request("alice", VICTIM_PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                       tenant="alice")
    engine.step()
    engine.add_request("bob", bob_prompt, GREEDY, tenant="bob")
    outputs: dict[str, Any] = {}
    with inject(Fault.FOREIGN_PAGE) if fault else contextlib.nullcontext():
        while engine.has_unfinished():
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
    return outputs


def test_foreign_page_fault_leaks_without_checks(make_llm: Callable[..., Any]) -> None:
    """With bob's block table naming alice's page, bob's prompt reaches alice's output."""
    alice_a = _bob_beside_alice(make_llm(), SECRET_A, fault=True)["alice"]
    alice_b = _bob_beside_alice(make_llm(), SECRET_B, fault=True)["alice"]
    assert alice_a.token_ids != alice_b.token_ids
    assert (_bob_beside_alice(make_llm(), SECRET_A, fault=False)["alice"].token_ids
            == _bob_beside_alice(make_llm(), SECRET_B, fault=False)["alice"].token_ids)


def test_checked_mode_catches_a_foreign_page(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(check_kv=True)
    outputs = _bob_beside_alice(llm, SECRET_A, fault=True)
    aborted = [o for o in outputs.values() if o.finish_reason is FinishReason.ABORT]
    assert aborted and all("does not own" in o.error for o in aborted)
    llm.engine.check_integrity()
    assert llm.engine.kv.num_used_pages == 0


def test_integrity_check_fails_on_a_double_owned_page(make_llm: Callable[..., Any]) -> None:
    allocator = make_llm().engine.kv.allocator
    allocator.allocate("a", "alice", 2)
    allocator.allocate("b", "bob", 1)
    allocator.check_integrity()
    allocator._pages["b"].append(allocator.pages_of("a")[0])  # corrupt: page of a also listed for b
    with pytest.raises(AssertionError, match="two owners"):
        allocator.check_integrity()
