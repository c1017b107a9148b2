"""Decode's NIXL arena holds no tenant's KV past its transfer: its pages are zeroed, tags and KV,
when a transfer gets them and when it gives them back. Over NIXL decode records what the sender's
notification names, so a short WRITE (a layer's V left out, still notified) is not refused: what
it left out reads as zeros (that tenant's own answer is wrong), never another tenant's KV. Each
test has a negative control with the zeroing switched off (`SKIP_ARENA_ZEROING`, test-only)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pd_harness import Handoff, PdPair
from test_handoff import args
from transports import needs_nixl

from kvseal import SamplingParams
from kvseal._testing.faults import Fault, inject
from kvseal.disagg.nixl import NixlReceiver, decode_address
from kvseal.models.loader import load_model

pytestmark = needs_nixl

ALICE, BOB = 300, 400  # marker tokens: the marker model answers with the marker its KV holds
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
NUM_PROMPT = 30  # 7.5 pages of 4


@pytest.fixture
def pair(marker_dir: Path) -> Iterator[PdPair]:
    pd = PdPair(args(marker_dir), args(marker_dir), loaded=load_model(str(marker_dir), args(marker_dir).torch_dtype),
                kv_transport="nixl", transfer_drain_s=0.5)
    yield pd
    pd.close()


def receiver_of(pair: PdPair) -> NixlReceiver:
    receiver = pair.decode.transport
    assert isinstance(receiver, NixlReceiver)
    return receiver


def arena_pages(handoff: Handoff) -> list[int]:
    assert handoff.reserved is not None
    return decode_address(handoff.reserved.kv_address).arena_pages()


def v_of_layer_0(pair: PdPair, handoff: Handoff) -> torch.Tensor:
    """V of layer 0, prompt positions, in decode's pool: [num_kv_heads, NUM_PROMPT, head_dim]."""
    assert handoff.reserved is not None
    part = pair.decode.engine.kv.pool.v[0][:, torch.tensor(handoff.reserved.pages)]
    return part.reshape(part.shape[0], -1, part.shape[-1])[:, :NUM_PROMPT].clone()


def short_write_after_alice(pair: PdPair) -> tuple[Handoff, torch.Tensor, torch.Tensor]:
    """Alice's request runs to its end; then bob's, whose WRITE leaves out layer 0's V
    (`SHORT_NIXL_WRITE`) in the arena pages alice's transfer used. Returns bob's handoff, once
    decode answered its first token, with alice's V of layer 0 and what bob's decode pages hold there."""
    alice = pair.generate([ALICE] * NUM_PROMPT, GREEDY, tenant="alice")
    assert alice.token_ids == [ALICE] * 6 and alice.final.error is None
    alice_v = v_of_layer_0(pair, alice)  # what decode imported for her (its pool is not scrubbed here)
    assert torch.count_nonzero(alice_v) > 0
    with inject(Fault.SHORT_NIXL_WRITE):
        bob = pair.reserve([BOB] * NUM_PROMPT, GREEDY, tenant="bob")
        assert arena_pages(bob) == arena_pages(alice), "bob's transfer must reuse alice's arena pages"
        pair.to_prefill.send(pair.prefill_msg(bob, [BOB] * NUM_PROMPT, GREEDY, tenant="bob"))
        pair.pump(lambda: bool(bob.outputs) or bob.is_terminal, "bob's first token")
    return bob, alice_v, v_of_layer_0(pair, bob)


def test_a_short_nixl_write_reads_zeros_never_an_earlier_tenants_kv(pair: PdPair) -> None:
    """The WRITE is not refused (decode records what the notification names), but the V it left
    out is zeros in bob's pages, and alice's marker never reaches bob's answer."""
    bob, alice_v, bob_v = short_write_after_alice(pair)
    assert torch.count_nonzero(bob_v) == 0, "what bob's WRITE left out must read as zeros"
    pair.wait(bob)
    assert ALICE not in bob.token_ids, bob.token_ids
    assert receiver_of(pair).num_refused == 0  # honest: not refused, only zeros
    pair.assert_clean()


def test_without_arena_zeroing_a_short_write_hands_bob_alices_kv(pair: PdPair) -> None:
    """Negative control: with `SKIP_ARENA_ZEROING` the same short WRITE gives bob's pages alice's
    V, left in the arena, and bob's answer carries her marker, with no check firing."""
    with inject(Fault.SKIP_ARENA_ZEROING):
        bob, alice_v, bob_v = short_write_after_alice(pair)
        assert torch.equal(bob_v, alice_v)
        pair.wait(bob)
    assert ALICE in bob.token_ids, bob.token_ids
    assert receiver_of(pair).num_refused == 0


def arena_bytes(receiver: NixlReceiver, pages: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The tags and the KV (every layer, K and V, every kv head) of arena `pages`."""
    return receiver._tags[pages], receiver._body[:, :, :, pages]


def test_a_finished_requests_arena_pages_are_zeros(pair: PdPair) -> None:
    """Once a request ended, nothing of its KV is left in the arena pages its transfer used,
    which a holder of decode's NIXL metadata could READ."""
    alice = pair.generate([ALICE] * NUM_PROMPT, GREEDY, tenant="alice")
    assert alice.token_ids == [ALICE] * 6
    pair.assert_clean()
    tags, body = arena_bytes(receiver_of(pair), arena_pages(alice))
    assert torch.count_nonzero(tags) == 0 and torch.count_nonzero(body) == 0


def test_without_arena_zeroing_a_finished_requests_kv_stays_in_the_arena(pair: PdPair) -> None:
    """Negative control: with `SKIP_ARENA_ZEROING` the tags and alice's V stay there (the marker
    model's K is zeros)."""
    with inject(Fault.SKIP_ARENA_ZEROING):
        alice = pair.generate([ALICE] * NUM_PROMPT, GREEDY, tenant="alice")
    pair.assert_clean()
    tags, body = arena_bytes(receiver_of(pair), arena_pages(alice))
    assert torch.count_nonzero(tags) > 0
    assert torch.count_nonzero(body[0, 1]) > 0


def authorize_over_junk(pair: PdPair) -> tuple[NixlReceiver, list[int]]:
    """Every arena page, free, holds junk (as a late write of a transfer long released would leave
    it); then a transfer is authorized. Returns the receiver and the transfer's arena pages."""
    receiver = receiver_of(pair)
    receiver._arena.fill_(0x7F)
    receiver.authorize("t-1", [0, 1, 2], key=bytes(32))
    return receiver, decode_address(receiver.address_for("t-1")).arena_pages()


def end_transfer(receiver: NixlReceiver, transfer_id: str) -> None:
    receiver.sender_done(transfer_id)
    assert receiver.cancel(transfer_id)


@pytest.mark.parametrize("zeroing", [True, False], ids=["zeroed", "SKIP_ARENA_ZEROING"])
def test_a_transfers_arena_pages_start_as_zeros_whatever_a_late_write_left(pair: PdPair, zeroing: bool) -> None:
    """Arena pages handed to a transfer are zeros, tags and KV, even when a write landed in them
    while they were free; with `SKIP_ARENA_ZEROING` (negative control) only the tags are."""
    if zeroing:
        receiver, pages = authorize_over_junk(pair)
    else:
        with inject(Fault.SKIP_ARENA_ZEROING):
            receiver, pages = authorize_over_junk(pair)
    tags, body = arena_bytes(receiver, pages)
    assert torch.count_nonzero(tags) == 0
    assert (torch.count_nonzero(body) == 0) == zeroing
    others = [page for page in range(receiver._layout.num_pages) if page not in pages]
    assert (receiver._body[:, :, :, others].contiguous().view(torch.uint8) == 0x7F).all(), "only its pages"
    end_transfer(receiver, "t-1")
    pair.assert_clean()

