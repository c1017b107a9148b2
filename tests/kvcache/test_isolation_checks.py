"""I3, I4 and I7: the always-on check and checked mode refuse reads of unwritten or foreign
KV; scrub modes wipe freed pages.

The fault switch PLACEHOLDER_PREFILL reproduces the incident's placeholder path: a prompt's
prefill is replaced by one token while the request is counted as fully prefilled. With the
checks bypassed (BYPASS_KV_CHECKS), the request then decodes over whatever the pages held
before: another tenant's KV. FOREIGN_PAGE makes a block table name another request's page.
Both are caught in the default configuration (no --check-kv, no scrub).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kvseal import FinishReason, SamplingParams
from kvseal._testing.faults import Fault, inject
from kvseal.types import ISOLATION_CHECK_FAILED

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
VICTIM_PROMPT = list(range(10, 40))
SECRET_A = list(range(300, 330))
SECRET_B = list(range(400, 430))


@contextlib.contextmanager
def _faults(*faults: Fault) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for fault in faults:
            stack.enter_context(inject(fault))
        yield


def _after_secret(llm: Any, secret: list[int], *faults: Fault) -> Any:
    """alice sends a secret and finishes; then bob's prompt runs, with `faults` switched on."""
    llm.generate([secret], GREEDY, tenant="alice")
    with _faults(*faults):
        return llm.generate([VICTIM_PROMPT], GREEDY, tenant="bob")[0]


PLACEHOLDER_UNCHECKED = (Fault.PLACEHOLDER_PREFILL, Fault.BYPASS_KV_CHECKS)


def test_placeholder_fault_leaks_without_checks(make_llm: Callable[..., Any]) -> None:
    """The fault is real: with the checks bypassed, bob's output depends on what alice sent."""
    out_a = _after_secret(make_llm(), SECRET_A, *PLACEHOLDER_UNCHECKED)
    out_b = _after_secret(make_llm(), SECRET_B, *PLACEHOLDER_UNCHECKED)
    assert out_a.finish_reason is FinishReason.LENGTH
    assert out_a.token_ids != out_b.token_ids
    clean_a = _after_secret(make_llm(), SECRET_A)
    clean_b = _after_secret(make_llm(), SECRET_B)
    assert clean_a.token_ids == clean_b.token_ids


def _assert_refused_and_recovered(llm: Any, out: Any, make_llm: Callable[..., Any]) -> None:
    assert out.finish_reason is FinishReason.ABORT and out.error_code == ISOLATION_CHECK_FAILED
    assert out.error and "isolation check failed" in out.error and "never wrote" in out.error
    assert out.token_ids == []
    assert llm.engine.stats().num_isolation_violations == 1
    llm.engine.check_integrity()
    assert llm.engine.kv.num_used_pages == 0
    # The engine keeps serving correctly after refusing the bad forward.
    healthy = _after_secret(llm, SECRET_A).token_ids
    assert healthy == _after_secret(make_llm(), SECRET_B).token_ids


def test_default_config_catches_the_placeholder_fault(make_llm: Callable[..., Any]) -> None:
    """No --check-kv, no scrub: the always-on coverage check refuses the forward."""
    llm = make_llm()
    assert not llm.engine.cache_config.check_kv and llm.engine.cache_config.kv_scrub == "off"
    out = _after_secret(llm, SECRET_A, Fault.PLACEHOLDER_PREFILL)
    assert "layer 0 holds KV for [0, 0)" in out.error
    _assert_refused_and_recovered(llm, out, make_llm)


def test_checked_mode_catches_the_placeholder_fault(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(check_kv=True)
    out = _after_secret(llm, SECRET_A, Fault.PLACEHOLDER_PREFILL)
    _assert_refused_and_recovered(llm, out, make_llm)


def test_scrub_free_removes_the_dependency_on_earlier_tenants(make_llm: Callable[..., Any]) -> None:
    out_a = _after_secret(make_llm(kv_scrub="free"), SECRET_A, *PLACEHOLDER_UNCHECKED)
    out_b = _after_secret(make_llm(kv_scrub="free"), SECRET_B, *PLACEHOLDER_UNCHECKED)
    assert out_a.finish_reason is FinishReason.LENGTH
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
    llm = make_llm(check_kv=True, enable_prefix_caching=False)  # cached pages: test_prefix_cache.py
    pages = _pages_after_one_request(llm)
    pool = llm.engine.kv.pool
    for layer in range(len(pool.k)):
        k, v = pool.read_pages(layer, torch.tensor(pages))
        assert torch.isnan(k).all() and torch.isnan(v).all()


def test_scrub_free_zeroes_pages_on_free(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(kv_scrub="free", enable_prefix_caching=False)
    pages = _pages_after_one_request(llm)
    pool = llm.engine.kv.pool
    assert (pool.read_pages(0, torch.tensor(pages))[0] == 0).all()
    assert (pool.read_pages(1, torch.tensor(pages))[1] == 0).all()


def test_scrub_alloc_zeroes_pages_when_handed_out(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(kv_scrub="alloc", enable_prefix_caching=False)
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
    llm = make_llm(enable_prefix_caching=False)  # a's full pages would stay cached
    engine = llm.engine
    engine.add_request("a", SECRET_A, SamplingParams(max_tokens=2, ignore_eos=True), tenant="alice")
    engine.step()
    assert engine.kv.num_written_tokens("a") == len(SECRET_A)
    pages = engine.kv.allocator.pages_of("a")
    engine.abort("a")
    engine.kv.reserve("b", "bob", len(SECRET_A))
    assert engine.kv.allocator.pages_of("b") == pages
    assert engine.kv.num_written_tokens("b") == 0


def _bob_beside_alice(llm: Any, bob_prompt: list[int], *faults: Fault) -> Any:
    """alice is mid-generation (her pages are live) when bob arrives; `faults` on from then."""
    engine = llm.engine
    engine.add_request("alice", VICTIM_PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                       tenant="alice")
    engine.step()
    engine.add_request("bob", bob_prompt, GREEDY, tenant="bob")
    outputs: dict[str, Any] = {}
    with _faults(*faults):
        while engine.has_unfinished():
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
    return outputs


FOREIGN_UNCHECKED = (Fault.FOREIGN_PAGE, Fault.BYPASS_KV_CHECKS)


def test_foreign_page_fault_leaks_without_checks(make_llm: Callable[..., Any]) -> None:
    """With bob's block table naming alice's page, bob's prompt reaches alice's output."""
    alice_a = _bob_beside_alice(make_llm(), SECRET_A, *FOREIGN_UNCHECKED)["alice"]
    alice_b = _bob_beside_alice(make_llm(), SECRET_B, *FOREIGN_UNCHECKED)["alice"]
    assert alice_a.finish_reason is FinishReason.LENGTH
    assert alice_a.token_ids != alice_b.token_ids
    assert (_bob_beside_alice(make_llm(), SECRET_A)["alice"].token_ids
            == _bob_beside_alice(make_llm(), SECRET_B)["alice"].token_ids)


@pytest.mark.parametrize("check_kv", [False, True], ids=["default", "checked"])
def test_a_foreign_page_is_refused(make_llm: Callable[..., Any], check_kv: bool) -> None:
    llm = make_llm(check_kv=check_kv)
    outputs = _bob_beside_alice(llm, SECRET_A, Fault.FOREIGN_PAGE)
    aborted = [o for o in outputs.values() if o.finish_reason is FinishReason.ABORT]
    assert aborted and all("does not own" in o.error and o.error_code == ISOLATION_CHECK_FAILED for o in aborted)
    assert llm.engine.stats().num_isolation_violations == len(aborted)
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


def test_bypass_switches_off_checked_mode_too(make_llm: Callable[..., Any]) -> None:
    """BYPASS_KV_CHECKS removes every check, so the outer layers (canary) can be tested."""
    llm = make_llm(check_kv=True)
    out = _after_secret(llm, SECRET_A, *PLACEHOLDER_UNCHECKED)
    assert out.finish_reason is FinishReason.LENGTH and out.error is None
    assert llm.engine.stats().num_isolation_violations == 0


# ---- a neighbour's content moves no bit of a request's numbers ------------------------------

SAMPLED_WITH_LOGPROBS = SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True, logprobs=5)


def _alice_numbers_beside(llm: Any, bob_prompt: list[int], *faults: Fault) -> tuple[Any, ...]:
    """alice's tokens and every logprob she is sent (her top 5 at each step), with bob's prompt in
    her batch from her first step on and `faults` switched on throughout."""
    engine = llm.engine
    engine.add_request("alice", VICTIM_PROMPT, SAMPLED_WITH_LOGPROBS, tenant="alice")
    engine.add_request("bob", bob_prompt, SAMPLED_WITH_LOGPROBS, tenant="bob")
    outputs: dict[str, Any] = {}
    with _faults(*faults):
        while engine.has_unfinished():
            outputs.update({o.request_id: o for o in engine.step() if o.finished})
    alice = outputs["alice"]
    assert alice.finish_reason is FinishReason.LENGTH, alice.error
    return tuple(alice.token_ids), tuple((lp.logprob, lp.top) for lp in alice.logprobs)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("native", ["auto", "off"], ids=["native", "torch-ops"])
def test_a_neighbours_content_moves_no_bit_of_a_requests_numbers(make_llm: Callable[..., Any], dtype: str,
                                                                 native: str) -> None:
    """The batch's shape may change the order of a sum (a seeded draw or a near-tie can then
    flip, as the README says); what the other requests hold must not change one bit of a
    request's logits. bob's two prompts have the same length, so both runs are scheduled alike:
    alice's logprobs, top 5 included, are bit-equal beside either. With bob's block table naming
    alice's page and the checks bypassed they differ: the comparison sees a foreign read even
    where no token flips."""
    def numbers(secret: list[int], *faults: Fault) -> tuple[Any, ...]:
        return _alice_numbers_beside(make_llm(dtype=dtype, native=native), secret, *faults)

    assert numbers(SECRET_A) == numbers(SECRET_B)
    assert numbers(SECRET_A, *FOREIGN_UNCHECKED)[1] != numbers(SECRET_B, *FOREIGN_UNCHECKED)[1]
