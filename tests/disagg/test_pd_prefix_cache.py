"""Prefix caching in PD mode (I5): decode's reservation takes its hit in the tenant's namespace,
prefill pushes only the positions after it, decode verifies coverage from the hit on and
publishes what it received; cached pages are never written by a transfer, and every way a
reservation ends gives its cache references back. Over both transports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pd_harness import Handoff, PdPair
from test_handoff import args
from transports import NIXL

from kvseal import LLM, SamplingParams
from kvseal._testing.faults import Fault, inject
from kvseal.disagg.msgs import HANDOFF_FAILED, CommitMsg, KVBlockMsg, PrefillDoneMsg, WrittenRangeMsg
from kvseal.disagg.tcp import TcpSender
from kvseal.disagg.transport import TransportError
from kvseal.messages.msgs import AbortMsg, ForgetTenantMsg
from kvseal.models.loader import load_model
from kvseal.types import ISOLATION_CHECK_FAILED

PAGE = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
SYSTEM = list(range(300, 341))  # 41 tokens: a long shared prefix, 10 full pages
PROMPTS = [SYSTEM + [5, 6, 7], SYSTEM + [9], SYSTEM + [5, 6, 7, 8, 11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def loaded(llama_dir: Path) -> Any:
    return load_model(str(llama_dir), args(llama_dir).torch_dtype)


@pytest.fixture(params=["tcp", "tcp-stream", NIXL])
def make_pair(llama_dir: Path, loaded: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    pairs: list[PdPair] = []

    def make(reservation_timeout_s: float = 30.0, prefill: dict[str, Any] | None = None, **engine: Any) -> PdPair:
        pairs.append(PdPair(args(llama_dir, **{**engine, **(prefill or {})}), args(llama_dir, **engine), loaded=loaded,
                            kv_transport=request.param, reservation_timeout_s=reservation_timeout_s,
                            transfer_drain_s=0.5))
        return pairs[-1]

    yield make
    for pair in pairs:
        pair.close()


def cache_off(llama_dir: Path, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Colocated generation with the prefix cache off: the reference every PD output must equal."""
    llm = LLM(str(llama_dir), kv_cache_tokens=512, page_size=PAGE, max_num_batched_tokens=32, dtype="float32",
              max_model_len=256, enable_prefix_caching=False)
    return [o.token_ids for o in llm.generate(prompts, params)]


def transfer_bytes(handoff: Handoff) -> int:
    assert isinstance(handoff.prefill_result, PrefillDoneMsg), handoff.prefill_result
    return handoff.prefill_result.num_bytes


def assert_cache_unread(pair: PdPair) -> None:
    """Both engines clean, and no cached page is still read by anyone (all evictable)."""
    pair.assert_clean()
    for node in (pair.prefill, pair.decode):
        allocator = node.engine.kv.allocator
        assert all(allocator.cached_page(p).num_readers == 0  # type: ignore[union-attr]
                   for p in allocator.cached_namespaces())


def test_same_tenant_hits_decodes_cache_and_moves_only_the_rest(make_pair: Any, llama_dir: Path) -> None:
    pair = make_pair()
    expected = cache_off(llama_dir, PROMPTS, GREEDY)
    first = pair.generate(PROMPTS[0], GREEDY)
    assert first.reserved is not None and first.reserved.num_cached_tokens == 0
    assert first.final.num_cached_tokens == 0
    assert pair.decode.engine.kv.num_cached_pages >= len(SYSTEM) // PAGE, "decode published what it received"
    later = [pair.generate(p, GREEDY) for p in PROMPTS[1:]]
    for handoff, hit in zip(later, [40, 44]):  # full pages shared with PROMPTS[0] (SYSTEM + [5, 6, 7])
        assert handoff.reserved.num_cached_tokens == hit  # type: ignore[union-attr]
        assert handoff.final.num_cached_tokens == hit, "usage reports decode's hit"
        assert transfer_bytes(handoff) < transfer_bytes(first), "only the positions after the hit moved"
    assert [h.token_ids for h in [first, *later]] == expected, "greedy output equals the cache-off output"
    assert_cache_unread(pair)


def test_a_repeated_prompt_hits_all_but_its_last_token(make_pair: Any, llama_dir: Path) -> None:
    pair = make_pair()
    prompt = SYSTEM + [5, 6, 7]  # 44 tokens: whole pages; the last one is always transferred
    first, second = pair.generate(prompt, GREEDY), pair.generate(prompt, GREEDY)
    assert second.final.num_cached_tokens == (len(prompt) - 1) // PAGE * PAGE
    assert first.token_ids == second.token_ids == cache_off(llama_dir, [prompt], GREEDY)[0]
    assert_cache_unread(pair)


def test_another_tenants_identical_prompt_does_not_hit(make_pair: Any) -> None:
    pair = make_pair()
    alice = pair.generate(PROMPTS[0], GREEDY, tenant="alice")
    bob = pair.generate(PROMPTS[0], GREEDY, tenant="bob")
    assert bob.reserved is not None and bob.reserved.num_cached_tokens == 0
    assert bob.final.num_cached_tokens == 0 and bob.final.error is None
    assert bob.token_ids == alice.token_ids
    assert pair.generate(PROMPTS[0], GREEDY, tenant="bob").final.num_cached_tokens > 0  # bob's own pages
    assert_cache_unread(pair)


def test_dropping_the_namespace_makes_the_cross_tenant_check_detect_a_hit(make_pair: Any) -> None:
    """The cross-tenant check above can fail: with the namespace dropped from the key, bob's
    reservation takes alice's pages (reported as cached tokens), and decode's ownership check
    (I3: a shared page must be of the reader's namespace) refuses bob's first decode step.
    (Prefill's cache is off here: with the fault its own ownership check would refuse first.)"""
    pair = make_pair(prefill=dict(enable_prefix_caching=False))
    with inject(Fault.DROP_CACHE_NAMESPACE):
        pair.generate(PROMPTS[0], GREEDY, tenant="alice")
        bob = pair.generate(PROMPTS[0], GREEDY, tenant="bob")
    assert bob.reserved is not None and bob.reserved.num_cached_tokens > 0, "the check must detect the hit"
    assert bob.final.num_cached_tokens > 0
    assert bob.final.error_code == ISOLATION_CHECK_FAILED and "does not own" in (bob.final.error or "")
    assert_cache_unread(pair)


def test_no_prefix_caching_turns_it_off_in_both_roles(make_pair: Any, llama_dir: Path) -> None:
    pair = make_pair(enable_prefix_caching=False)
    handoffs = [pair.generate(PROMPTS[0], GREEDY) for _ in range(2)]
    assert [h.final.num_cached_tokens for h in handoffs] == [0, 0]
    assert transfer_bytes(handoffs[0]) == transfer_bytes(handoffs[1])
    assert [h.token_ids for h in handoffs] == cache_off(llama_dir, [PROMPTS[0]], GREEDY) * 2
    assert pair.prefill.engine.kv.num_cached_pages == pair.decode.engine.kv.num_cached_pages == 0
    pair.assert_clean()


# ---- cached pages are read-only; every end of a reservation gives its references back -----

def warm(pair: PdPair) -> Handoff:
    """Publish SYSTEM in decode's cache, then reserve a prompt that hits it (no prefill yet)."""
    pair.generate(PROMPTS[0], GREEDY)
    handoff = pair.reserve(PROMPTS[1], GREEDY)
    assert handoff.reserved is not None and handoff.reserved.num_cached_tokens > 0
    return handoff


def cached_pages_of(pair: PdPair, handoff: Handoff) -> list[int]:
    r = handoff.reserved
    assert r is not None
    pages = r.pages[:r.num_cached_tokens // PAGE]
    assert all(pair.decode.engine.kv.allocator.cached_page(p) is not None for p in pages)
    return pages


def test_a_transfer_never_writes_a_cached_page(make_pair: Any, llama_dir: Path) -> None:
    """A broken prefill that pushes from position 0 (ignoring the hit) cannot change a cached
    page: TCP frames and tcp-stream blocks before the hit are refused as writes outside the
    reservation, NIXL's land
    only in the arena and are never imported there. The handoff still completes correctly."""
    pair = make_pair()
    handoff = warm(pair)
    r = handoff.reserved
    assert r is not None
    pool = pair.decode.engine.kv.pool
    cached = torch.tensor(cached_pages_of(pair, handoff))
    before = [(k.index_select(1, cached).clone(), v.index_select(1, cached).clone()) for k, v in zip(pool.k, pool.v)]
    prefill_pool = pair.prefill.engine.kv.pool
    prefill_pool.fill(list(range(prefill_pool.num_pages)), 7.0)  # what the rogue push would write
    plan = pair.plan(r, list(range(len(r.pages))), [len(PROMPTS[1])] * 2)
    if pair.prefill.config.kv_transport == "tcp":
        TcpSender(pair.rogue).push(plan, prefill_pool)
        link = pair.peer_link()
        link.send(KVBlockMsg(r.transfer_id, 0, "k", 0, PAGE), [prefill_pool.export_pages(0, torch.arange(1))[0]
                  .view(torch.uint8).numpy().tobytes()])
        pair.pump(lambda: pair.decode.link.stats().handoff_failures.get("write_outside_reservation", 0) == 5,
                  "the refusals")  # 2 layers x K/V of the push, and the single frame
    elif pair.prefill.config.kv_transport == "tcp-stream":  # every block starts at 0: refused, read into scratch
        pair.prefill.transport.push(plan, prefill_pool)  # type: ignore[union-attr]
        pair.pump(lambda: pair.decode.link.stats().handoff_failures.get("write_outside_reservation", 0) == 4,
                  "the refusals")  # 2 layers x K/V of the push
    else:  # the transfer's address names arena pages from the hit on only: the sender refuses the rest
        with pytest.raises(TransportError, match="before the reservation's first writable page"):
            pair.prefill.transport.push(plan, prefill_pool)  # type: ignore[union-attr]
        receiver = pair.decode.steps.receiver  # type: ignore[attr-defined]
        receiver.sender_done(r.transfer_id)
        landing = receiver.landed(r.transfer_id)  # waits for NIXL's notification and imports the write
        assert landing is not None and all(s >= r.num_cached_tokens for ranges in landing.ranges.values()
                                           for s, _ in ranges)
    after = [(k.index_select(1, cached), v.index_select(1, cached)) for k, v in zip(pool.k, pool.v)]
    assert all(torch.equal(a, b) for pa, pb in zip(before, after) for a, b in zip(pa, pb)), "a cached page changed"
    pair.to_decode.send(AbortMsg(handoff.request_id, "alice", "test over"))
    pair.pump(lambda: handoff.is_terminal, "the abort")
    assert_cache_unread(pair)


@pytest.mark.parametrize(("claimed_start", "pushed_start", "reason"), [
    (0, None, "the commit claims (0, 42)"),  # claims the cached positions as transferred
    (None, 4, "before position 40"),  # what landed does not start at the hit
])
def test_a_commit_that_does_not_start_at_the_hit_is_refused(
        make_pair: Any, claimed_start: int | None, pushed_start: int | None, reason: str) -> None:
    pair = make_pair()
    handoff = warm(pair)
    r = handoff.reserved
    assert r is not None and r.num_cached_tokens == 40 and len(PROMPTS[1]) == 42
    end = len(PROMPTS[1])
    start = r.num_cached_tokens if pushed_start is None else pushed_start
    if pushed_start is None:
        plan = pair.plan(r, list(range(len(r.pages))), [end, end], start=start)
        sender = TcpSender(pair.rogue) if pair.prefill.config.kv_transport == "tcp" else pair.prefill.transport
        sender.push(plan, pair.prefill.engine.kv.pool)  # type: ignore[union-attr]
    else:  # a receiver that let a write before the hit land: verification refuses it anyway
        receiver = pair.decode.steps.receiver  # type: ignore[attr-defined]
        receiver.landed(r.transfer_id).add(0, "k", pushed_start, end, 0)
        if pair.prefill.config.kv_transport == "tcp-stream":  # the stream's end record, or the commit waits
            nothing = pair.plan(r, list(range(len(r.pages))), [0, 0])
            pair.prefill.transport.push(nothing, pair.prefill.engine.kv.pool)  # type: ignore[union-attr]
    claimed = r.num_cached_tokens if claimed_start is None else claimed_start
    pair.peer_link().send(CommitMsg(
        r.transfer_id, handoff.request_id, "alice", end, [WrittenRangeMsg(layer, claimed, end) for layer in range(2)],
        5, None, torch.Generator().get_state().numpy().tobytes(), "rogue"))
    pair.pump(lambda: handoff.is_terminal, "the refusal")
    assert handoff.final.error_code == ISOLATION_CHECK_FAILED and handoff.token_ids == []
    assert reason in (handoff.final.error or ""), handoff.final.error
    assert_cache_unread(pair)


def test_abort_during_a_transfer_from_a_hit_releases_the_references(make_pair: Any) -> None:
    pair = make_pair()
    handoff = warm(pair)
    pair.to_prefill.send(pair.prefill_msg(handoff, PROMPTS[1], GREEDY))
    pair.prefill.loop.run_once(idle_poll_ms=1)  # prefill has started
    pair.to_decode.send(AbortMsg(handoff.request_id, "alice", "client gone"))
    pair.to_prefill.send(AbortMsg(handoff.request_id, "alice", "client gone"))
    pair.pump(lambda: handoff.is_terminal and handoff.prefill_result is not None, "the abort on both sides")
    assert handoff.final.finish_reason == "abort"
    assert_cache_unread(pair)
    assert pair.generate(PROMPTS[1], GREEDY).final.num_cached_tokens > 0, "the cache still serves the tenant"
    assert_cache_unread(pair)


def test_expiry_and_placeholder_prefill_from_a_hit_leave_integrity_intact(make_pair: Any) -> None:
    # Prefill's cache off: the placeholder replaces a prefill from position 0 (a prefill that
    # starts on its own cache hit computes the rest for real).
    pair = make_pair(prefill=dict(enable_prefix_caching=False))
    # Only the reservation meant to expire gets the short timeout (a deadline is fixed when a
    # reservation is made): the warm-up and the victim must not expire on a slow host.
    pair.generate(PROMPTS[0], GREEDY)
    table = pair.decode.steps.table
    table.timeout_s = 0.5
    expiring = pair.reserve(PROMPTS[1], GREEDY)
    table.timeout_s = 30.0
    assert expiring.reserved is not None and expiring.reserved.num_cached_tokens > 0
    pair.pump(lambda: expiring.is_terminal, "the expiry")
    assert expiring.final.error_code == HANDOFF_FAILED
    assert_cache_unread(pair)
    victim = pair.reserve(PROMPTS[2], GREEDY)
    assert victim.reserved is not None and victim.reserved.num_cached_tokens > 0
    with inject(Fault.PLACEHOLDER_PREFILL), inject(Fault.BYPASS_KV_CHECKS):
        pair.to_prefill.send(pair.prefill_msg(victim, PROMPTS[2], GREEDY))
        pair.wait(victim)
    assert victim.final.error_code == ISOLATION_CHECK_FAILED and victim.token_ids == []
    assert_cache_unread(pair)


def test_a_reservation_that_fits_only_with_its_hit_is_placed_at_once(make_pair: Any, llama_dir: Path) -> None:
    """Pages a reservation's hit covers need no new page: with 5 of 16 pages free, a 43-token
    reservation (11 pages) whose first 10 pages are cached (read by a running request) is
    placed while that request still runs, not after it frees its pages."""
    pair = make_pair(kv_cache_tokens=64, max_model_len=64)
    longer = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    a_prompt, b_prompt = SYSTEM[:40], SYSTEM[:40] + [9, 9]
    a = pair.generate_start(a_prompt, longer)
    assert pair.decode.engine.kv.num_free_pages == 5
    b = pair.reserve(b_prompt, GREEDY, wait=False)
    pair.pump(lambda: b.reserved is not None, "b's reservation")
    assert not a.is_terminal and b.reserved.num_cached_tokens == 40  # type: ignore[union-attr]
    pair.to_prefill.send(pair.prefill_msg(b, b_prompt, GREEDY))
    pair.wait(b)
    pair.wait(a)
    assert [a.token_ids, b.token_ids] == [cache_off(llama_dir, [a_prompt], longer)[0],
                                          cache_off(llama_dir, [b_prompt], GREEDY)[0]]
    assert_cache_unread(pair)


def _alice_pages(pair: PdPair) -> list[list[int]]:
    return [node.engine.kv.allocator.cached_pages_of("alice") for node in (pair.prefill, pair.decode)]


def _forget_alice(pair: PdPair, ahead: list[str] | None = None) -> None:
    """As the frontend does after a reload removed alice: both engines are told."""
    pair.to_prefill.send(ForgetTenantMsg("alice", ahead or []))
    pair.to_decode.send(ForgetTenantMsg("alice"))
    pair.pump(lambda: all(node.engine.cache_epoch("alice") == 1 for node in (pair.prefill, pair.decode)),
              "both engines to forget alice")


def test_a_forgotten_tenant_name_starts_with_an_empty_cache_in_both_roles(make_pair: Any) -> None:
    pair = make_pair()
    pair.generate(PROMPTS[0], GREEDY, tenant="alice")
    pair.generate(PROMPTS[0], GREEDY, tenant="bob")
    assert all(_alice_pages(pair))
    bob_pages = [node.engine.kv.allocator.cached_pages_of("bob") for node in (pair.prefill, pair.decode)]
    _forget_alice(pair)
    assert _alice_pages(pair) == [[], []]
    assert [node.engine.kv.allocator.cached_pages_of("bob") for node in (pair.prefill, pair.decode)] == bob_pages
    again = pair.generate(PROMPTS[0], GREEDY, tenant="alice")
    assert again.reserved is not None and again.reserved.num_cached_tokens == 0
    assert again.final.num_cached_tokens == 0 and again.final.error is None
    assert pair.generate(PROMPTS[0], GREEDY, tenant="bob").final.num_cached_tokens > 0
    assert_cache_unread(pair)


def test_a_handoff_reserved_before_the_forget_stays_the_old_tenants(make_pair: Any) -> None:
    """The frontend reserved alice's request before her name was removed and sends it to prefill
    after: decode's reservation and prefill's request (named ahead in the forget) are closed to the
    cache, so nothing of it is cached for the name's next tenant."""
    pair = make_pair()
    pair.generate(PROMPTS[0], GREEDY, tenant="alice")
    old = pair.reserve(PROMPTS[0], GREEDY, tenant="alice")
    assert old.reserved is not None and old.reserved.num_cached_tokens > 0
    _forget_alice(pair, ahead=[old.request_id])
    pair.to_prefill.send(pair.prefill_msg(old, PROMPTS[0], GREEDY, "alice"))
    pair.wait(old)
    assert old.final.error is None and old.final.finish_reason == "length"
    assert _alice_pages(pair) == [[], []], "a request of the forgotten tenant fed the cache"
    again = pair.generate(PROMPTS[0], GREEDY, tenant="alice")
    assert again.reserved is not None and again.reserved.num_cached_tokens == 0
    assert_cache_unread(pair)
