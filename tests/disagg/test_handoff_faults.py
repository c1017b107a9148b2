"""Every way the handoff can go wrong ends in an error for the client, never in a decode step
over KV this request's transfer did not write, and leaves both engines clean (I1, I4, I6)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from pd_harness import Ends, Handoff, PdPair, TestFrontend
from processes import free_port
from test_handoff import GREEDY, args, colocated
from transports import NIXL, needs_nixl

from kvseal import SamplingParams
from kvseal._testing.faults import Fault, inject
from kvseal.disagg.config import NodeConfig
from kvseal.disagg.frontend import PdClient
from kvseal.disagg.link_keys import EngineEndpoint
from kvseal.disagg.msgs import (
    HANDOFF_FAILED,
    RESERVATION_UNCLAIMED,
    TRANSFER_FAILED,
    AbortUnsentMsg,
    CommitMsg,
    KVBlockMsg,
    PrefillDoneMsg,
    PrefillRefusedMsg,
    TransferAbortMsg,
    WrittenRangeMsg,
    decode,
)
from kvseal.disagg.nixl import ArenaPages, NixlSender, decode_address, part_sizes
from kvseal.disagg.node import EngineNode
from kvseal.disagg.prefill import REQUEST_ABORTED
from kvseal.disagg.tcp import TcpReceiver, TcpSender
from kvseal.disagg.transport import (
    CANCELLED,
    MAX_MEMMOVE_RUNS,
    PushPlan,
    RecentlyEnded,
    RunsMemo,
    copy_pages,
    joint_runs,
    zero_pages,
)
from kvseal.disagg.wire import PeerLinks
from kvseal.errors import ConfigError
from kvseal.kvcache.pool import KVPool
from kvseal.messages.convert import params_to_msg
from kvseal.messages.msgs import AbortMsg, AddRequestMsg, RequestOutputMsg, TokenLogprobsMsg
from kvseal.models.loader import load_model
from kvseal.types import ISOLATION_CHECK_FAILED, StructuredOutput

PROMPT = list(range(100, 130))  # 30 tokens: 7.5 pages of 4


@pytest.fixture(scope="module")
def loaded(llama_dir: Path) -> Any:
    return load_model(str(llama_dir), args(llama_dir).torch_dtype)


# the fault tests every transport must pass
TRANSPORTS = pytest.mark.parametrize("kv_transport", ["tcp", "tcp-stream", NIXL])


@pytest.fixture
def kv_transport() -> str:
    return "tcp"  # tests marked TRANSPORTS run over each


@pytest.fixture
def make_pair(llama_dir: Path, loaded: Any, kv_transport: str) -> Iterator[Any]:
    pairs: list[PdPair] = []

    def make(prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None, **kw: Any) -> PdPair:
        pairs.append(PdPair(args(llama_dir, **(prefill or {})), args(llama_dir, **(decode or {})), loaded=loaded,
                            kv_transport=kv_transport, **({"transfer_drain_s": 0.5} | kw)))
        return pairs[-1]

    yield make
    for pair in pairs:
        pair.close()


def assert_refused_by_decode(handoff: Handoff, reason_fragment: str, code: str = ISOLATION_CHECK_FAILED) -> None:
    """Decode ended the request with an error before producing a token. A commit that fails
    verification is an isolation check tripping; a reservation that expires is not."""
    final = handoff.final
    assert final.finished and final.finish_reason == "abort" and final.error_code == code, final
    assert reason_fragment in (final.error or ""), final.error
    assert handoff.token_ids == [], "decode produced a token for a refused handoff"


# ---- the incident's misconfiguration: prefill's limit is smaller than decode's -------------

@TRANSPORTS
def test_prefill_refuses_what_its_pool_cannot_hold_and_decode_releases(make_pair: Any) -> None:
    pair = make_pair(prefill=dict(kv_cache_tokens=64, max_model_len=64))
    handoff = pair.generate(list(range(10, 110)), GREEDY)  # 100 tokens: decode admits, prefill cannot
    assert handoff.reserved is not None, "decode's larger limit admits it"
    assert handoff.rejected is not None and handoff.rejected.http_status == 400
    assert handoff.rejected.code == "context_length_exceeded"
    assert isinstance(handoff.prefill_result, PrefillRefusedMsg)
    assert handoff.outputs == [] and pair.decode.engine.stats().num_running == 0
    assert pair.decode.link.stats().handoff_failures == {"prefill_refused": 1}
    pair.assert_clean()


@TRANSPORTS
def test_prefills_refusal_keeps_its_code_when_decodes_release_waits(make_pair: Any) -> None:
    """A receiver may answer a release with "ask again later" (`KVReceiver.cancel` False: a write
    could still land, as NIXL says before its completion). When the release of a reservation that
    prefill refused waits so, the end decode reports once it is done is prefill's refusal as it
    came (its code, status and param: the client's 400), never a failed handoff's 503."""
    pair = make_pair(prefill=dict(kv_cache_tokens=64, max_model_len=64))
    receiver = pair.decode.steps.table.receiver
    cancel, num_refused = receiver.cancel, []

    def cancel_later(transfer_id: str) -> bool:  # the first answer for a transfer is "not yet"
        if transfer_id not in num_refused:
            num_refused.append(transfer_id)
            return False
        return bool(cancel(transfer_id))

    receiver.cancel = cancel_later
    handoff = pair.generate(list(range(10, 110)), GREEDY)  # 100 tokens: decode admits, prefill cannot
    assert handoff.reserved is not None and num_refused == [handoff.reserved.transfer_id]
    assert handoff.outputs == [], "no end reported as a failed handoff"
    assert handoff.rejected is not None, "prefill's refusal reached the frontend"
    assert (handoff.rejected.code, handoff.rejected.http_status, handoff.rejected.param) == (
        "context_length_exceeded", 400, "prompt")
    assert not pair.decode.steps._pending_errors
    pair.assert_clean()


def test_decode_refuses_what_its_own_limit_cannot_hold(make_pair: Any) -> None:
    pair = make_pair(decode=dict(kv_cache_tokens=64, max_model_len=64))
    handoff = pair.reserve(list(range(10, 110)), GREEDY)
    assert handoff.refused is not None and handoff.refused.code == "context_length_exceeded"
    assert handoff.reserved is None
    pair.assert_clean()


# ---- commits that do not match what landed --------------------------------------------------

def rogue_push(pair: PdPair, handoff: Handoff, written: list[int]) -> int:
    """Push KV for `written[layer]` leading positions from prefill's pool, as a broken prefill would."""
    r = handoff.reserved
    assert r is not None
    plan = pair.plan(r, list(range(len(r.pages))), written)
    sender = TcpSender(pair.rogue) if pair.prefill.config.kv_transport == "tcp" else pair.prefill.transport
    return sender.push(plan, pair.prefill.engine.kv.pool)  # type: ignore[union-attr]


GENERATOR_STATE = torch.Generator().get_state().numpy().tobytes()


def rogue_commit(pair: PdPair, handoff: Handoff, num_tokens: int, written: list[int],
                 tenant: str = "alice", transfer_id: str | None = None, first_token: int = 5,
                 first_logprobs: TokenLogprobsMsg | None = None, generator_state: bytes = GENERATOR_STATE,
                 prompt_logprobs: list[TokenLogprobsMsg | None] | None = None) -> None:
    r = handoff.reserved
    assert r is not None
    pair.peer_link().send(CommitMsg(
        r.transfer_id if transfer_id is None else transfer_id, handoff.request_id, tenant, num_tokens,
        [WrittenRangeMsg(layer, 0, end) for layer, end in enumerate(written)], first_token, first_logprobs,
        generator_state, "rogue", prompt_logprobs))


def page_bytes(pair: PdPair, num_pages: int) -> bytes:
    """K of `num_pages` pages of layer 0 of prefill's pool, staged as the TCP transport sends it."""
    staged = pair.prefill.engine.kv.pool.export_pages(0, torch.arange(num_pages))[0]
    return staged.view(torch.uint8).numpy().tobytes()


NUM_LAYERS = 2


@TRANSPORTS
@pytest.mark.parametrize(("pushed", "claimed_tokens", "claimed", "reason"), [
    ([30, 30], 29, [30, 30], "the prompt has 30"),  # fewer tokens than reserved
    ([30, 0], 30, [30, 30], "layer 1 K: only positions [0, 0)"),  # one layer never written
    ([30, 17], 30, [30, 30], "layer 1 K: only positions [0, 17)"),  # one layer partly written
    ([30, 30], 30, [30, 12], "layer 1: the commit claims (0, 12)"),  # claim disagrees with what landed
    ([30, 30], 30, [30], "layer 1: the commit claims None"),  # a layer missing from the claim
    ([30, 30], 30, [30, 30, 30], "3 layer ranges"),  # a layer the model does not have
])
def test_decode_refuses_a_commit_that_does_not_match_what_landed(
        make_pair: Any, pushed: list[int], claimed_tokens: int, claimed: list[int], reason: str) -> None:
    pair = make_pair()
    handoff = pair.reserve(PROMPT, GREEDY)
    rogue_push(pair, handoff, pushed)
    rogue_commit(pair, handoff, claimed_tokens, claimed)
    pair.pump(lambda: handoff.is_terminal, "the refusal")
    assert_refused_by_decode(handoff, reason)
    pair.assert_clean()


def test_v_missing_in_one_layer_is_refused(make_pair: Any) -> None:
    pair = make_pair()
    handoff = pair.reserve(PROMPT, GREEDY)
    rogue_push(pair, handoff, [30, 30])
    other = pair.reserve(PROMPT, GREEDY)  # this transfer's V frames of layer 0 never arrive
    link, payload = pair.peer_link(), page_bytes(pair, 8)
    ro = other.reserved
    assert ro is not None
    for layer in range(NUM_LAYERS):
        link.send(KVBlockMsg(ro.transfer_id, layer, "k", 0, 30), [payload])
    link.send(KVBlockMsg(ro.transfer_id, 1, "v", 0, 30), [payload])
    rogue_commit(pair, other, 30, [30, 30])
    pair.pump(lambda: other.is_terminal, "the refusal")
    assert_refused_by_decode(other, "layer 0 V: only positions [0, 0)")
    rogue_commit(pair, handoff, 30, [30, 30])  # the first one was complete: it runs
    pair.pump(lambda: handoff.is_terminal, "the first request")
    assert handoff.final.finish_reason == "length"
    pair.assert_clean()


def test_a_forged_commit_does_not_touch_the_reservation(make_pair: Any) -> None:
    pair = make_pair(reservation_timeout_s=0.5)
    handoff = pair.reserve(PROMPT, GREEDY)
    rogue_push(pair, handoff, [30, 30])
    rogue_commit(pair, handoff, 30, [30, 30], tenant="mallory")  # another tenant's commit
    pair.pump(lambda: handoff.is_terminal, "the expiry")
    assert_refused_by_decode(handoff, "no sign of the prefill engine", HANDOFF_FAILED)
    assert pair.decode.link.stats().handoff_failures == {"identity_mismatch": 1, "expired": 1}
    pair.assert_clean()


# ---- what prefill sampled: every word of a commit is checked before it is used ---------------

LOGPROBS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)


def logprobs_of(token_id: int, logprob: float = -0.5, top: tuple[tuple[int, float], ...] = ((5, -0.5), (6, -1.0)),
                rank: int | None = None) -> TokenLogprobsMsg:
    return TokenLogprobsMsg(token_id, logprob, list(top), rank)


ALLOWED = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, allowed_token_ids=[7, 8])
PROMPT_LOGPROBS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=1)


def prompt_logprobs_of(prompt: list[int], **change: Any) -> list[TokenLogprobsMsg | None]:
    """What a sampler makes for PROMPT_LOGPROBS (position 3 changed as `change` says)."""
    entries: list[TokenLogprobsMsg | None] = [None]
    for position, token in enumerate(prompt[1:], start=1):
        fields = dict(token_id=token, logprob=-1.0, top=((7, -0.25),), rank=3)
        entries.append(logprobs_of(**(fields | change if position == 3 else fields)))  # type: ignore[arg-type]
    return entries


@pytest.mark.parametrize(("params", "sample", "reason", "message"), [
    (GREEDY, lambda vocab: dict(first_token=10**9), "bad_first_token", "outside the vocabulary"),
    (GREEDY, lambda vocab: dict(first_token=vocab), "bad_first_token", "outside the vocabulary"),
    (GREEDY, lambda vocab: dict(first_token=-1), "bad_first_token", "outside the vocabulary"),
    (ALLOWED, lambda vocab: dict(first_token=5), "bad_first_token", "not one of the request's allowed_token_ids"),
    (GREEDY, lambda vocab: dict(generator_state=b""), "bad_generator_state", "(0 bytes)"),
    (GREEDY, lambda vocab: dict(generator_state=b"\xff" * 7), "bad_generator_state", "(7 bytes)"),
    (GREEDY, lambda vocab: dict(generator_state=GENERATOR_STATE + b"\0"), "bad_generator_state", "is not"),
    # the right size, but no state of mt19937
    (GREEDY, lambda vocab: dict(generator_state=bytes(len(GENERATOR_STATE))), "bad_generator_state", "is not"),
    (GREEDY, lambda vocab: dict(first_logprobs=logprobs_of(5)), "bad_logprobs", "carries them"),
    (LOGPROBS, lambda vocab: dict(), "bad_logprobs", "lacks them"),
    (LOGPROBS, lambda vocab: dict(first_logprobs=logprobs_of(6)), "bad_logprobs", "the first token is 5"),
    (LOGPROBS, lambda vocab: dict(first_logprobs=logprobs_of(5, top=((5, -0.5),))), "bad_logprobs",
     "carries 1 alternatives"),
    (LOGPROBS, lambda vocab: dict(first_logprobs=logprobs_of(5, top=((5, -0.5), (vocab, -1.0)))), "bad_logprobs",
     "token ids lie in"),
    (LOGPROBS, lambda vocab: dict(first_logprobs=logprobs_of(5, logprob=float("nan"))), "bad_logprobs", "nan"),
    (LOGPROBS, lambda vocab: dict(first_logprobs=logprobs_of(5, logprob=0.5)), "bad_logprobs", "logprob 0.5"),
    (LOGPROBS, lambda vocab: dict(first_logprobs=logprobs_of(5, rank=0)), "bad_logprobs", "rank 0"),
    (GREEDY, lambda vocab: dict(prompt_logprobs=prompt_logprobs_of(PROMPT)), "bad_prompt_logprobs", "carries them"),
    (PROMPT_LOGPROBS, lambda vocab: dict(), "bad_prompt_logprobs", "lacks them"),
    (PROMPT_LOGPROBS, lambda vocab: dict(prompt_logprobs=prompt_logprobs_of(PROMPT)[:-1]), "bad_prompt_logprobs",
     "carries 29 prompt logprobs"),
    (PROMPT_LOGPROBS, lambda vocab: dict(prompt_logprobs=[logprobs_of(PROMPT[0]), *prompt_logprobs_of(PROMPT)[1:]]),
     "bad_prompt_logprobs", "the first prompt token"),
    (PROMPT_LOGPROBS, lambda vocab: dict(prompt_logprobs=prompt_logprobs_of(PROMPT, token_id=PROMPT[4])),
     "bad_prompt_logprobs", f"prompt token 3 is {PROMPT[3]}"),
    (PROMPT_LOGPROBS, lambda vocab: dict(prompt_logprobs=prompt_logprobs_of(PROMPT, top=())),
     "bad_prompt_logprobs", "carries 0 alternatives"),
    (PROMPT_LOGPROBS, lambda vocab: dict(prompt_logprobs=prompt_logprobs_of(PROMPT, top=((vocab, -1.0),))),
     "bad_prompt_logprobs", "token ids lie in"),
    (PROMPT_LOGPROBS, lambda vocab: dict(prompt_logprobs=prompt_logprobs_of(PROMPT, logprob=float("nan"))),
     "bad_prompt_logprobs", "nan"),
    (PROMPT_LOGPROBS, lambda vocab: dict(prompt_logprobs=prompt_logprobs_of(PROMPT, rank=vocab + 1)),
     "bad_prompt_logprobs", "is outside [1, "),
    (PROMPT_LOGPROBS, lambda vocab: dict(prompt_logprobs=[*prompt_logprobs_of(PROMPT)[:5], None,
                                                          *prompt_logprobs_of(PROMPT)[6:]]),
     "bad_prompt_logprobs", "prompt position 5: it has none"),
])
def test_decode_refuses_a_commit_whose_sample_no_sampler_made(
        make_pair: Any, params: SamplingParams, sample: Any, reason: str, message: str) -> None:
    """A peer lands the right KV and commits a first token, logprobs or generator state that no
    sampler produced: refused like any failed verification (isolation_check_failed, the reason
    counted, the pages free), and decode keeps serving. Unchecked, a token past the vocabulary
    reached the client and failed decode's next step, and a generator state of another size
    raised at once: either ended decode's loop, and every tenant's requests with it."""
    pair = make_pair()
    bystander = pair.generate_start(list(range(200, 220)), GREEDY, tenant="bob")
    handoff = pair.reserve(PROMPT, params)
    rogue_push(pair, handoff, [30, 30])
    rogue_commit(pair, handoff, 30, [30, 30], **sample(pair.decode.engine.limits.vocab_size))
    pair.pump(lambda: handoff.is_terminal, "the refusal")
    assert_refused_by_decode(handoff, message)
    assert pair.decode.link.stats().handoff_failures == {reason: 1}
    pair.wait(bystander)
    assert bystander.final.finish_reason == "length" and len(bystander.token_ids) == GREEDY.max_tokens
    pair.assert_clean()


def test_a_commit_with_logprobs_as_asked_runs(make_pair: Any) -> None:
    """The control: a sample a sampler could have made passes the same checks."""
    pair = make_pair()
    handoff = pair.reserve(PROMPT, LOGPROBS)
    rogue_push(pair, handoff, [30, 30])
    rogue_commit(pair, handoff, 30, [30, 30], first_logprobs=logprobs_of(5, logprob=float("-inf"), rank=7))
    pair.pump(lambda: handoff.is_terminal, "the request")
    assert handoff.final.finish_reason == "length" and handoff.token_ids[0] == 5
    assert pair.decode.link.stats().handoff_failures == {}
    pair.assert_clean()


def test_a_commit_with_prompt_logprobs_as_asked_runs(make_pair: Any) -> None:
    """The control for the prompt logprobs' checks: they pass, and reach the frontend as sent."""
    pair = make_pair()
    handoff = pair.reserve(PROMPT, PROMPT_LOGPROBS)
    rogue_push(pair, handoff, [30, 30])
    sent = prompt_logprobs_of(PROMPT)
    rogue_commit(pair, handoff, 30, [30, 30], prompt_logprobs=sent)
    pair.pump(lambda: handoff.is_terminal, "the request")
    assert handoff.final.finish_reason == "length" and handoff.outputs[0].prompt_logprobs == sent
    assert pair.decode.link.stats().handoff_failures == {}
    pair.assert_clean()


# ---- writes decode never authorized ---------------------------------------------------------

def test_decode_refuses_writes_it_did_not_authorize(make_pair: Any, llama_dir: Path) -> None:
    pair = make_pair()
    handoff = pair.reserve(PROMPT, GREEDY)
    r = handoff.reserved
    assert r is not None
    page = page_bytes(pair, 8)
    before = [t.clone() for t in pair.decode.engine.kv.pool.k]
    link = pair.peer_link()
    link.send(KVBlockMsg("not-a-transfer", 0, "k", 0, 30), [page])  # unknown transfer id
    link.send(KVBlockMsg(r.transfer_id, 0, "k", 0, 4 * len(r.pages) + 4), [page])  # past the reservation
    link.send(KVBlockMsg(r.transfer_id, 0, "k", 2, 30), [page])  # not page-aligned
    link.send(KVBlockMsg(r.transfer_id, 5, "k", 0, 30), [page])  # no such layer
    link.send(KVBlockMsg(r.transfer_id, 0, "k", 0, 30), [page[:-2]])  # wrong size
    _, page_size, head_dim = pair.decode.engine.kv.pool.page_shape()
    half = page_size * head_dim * 4 // 2  # the right total, but frames that cut a page in two (float32)
    link.send(KVBlockMsg(r.transfer_id, 0, "k", 0, 30), [page[:half], page[half:]])
    pair.pump(lambda: sum(pair.decode.link.stats().handoff_failures.values()) == 6, "the refusals")
    assert pair.decode.link.stats().handoff_failures == {
        "unauthorized_transfer": 1, "write_outside_reservation": 2, "bad_block_address": 1, "bad_block_size": 2}
    assert all(torch.equal(a, b) for a, b in zip(before, pair.decode.engine.kv.pool.k)), "a refused write landed"
    # The reservation is intact and a correct handoff still completes.
    pair.to_prefill.send(pair.prefill_msg(handoff, PROMPT, GREEDY))
    pair.wait(handoff)
    assert handoff.token_ids == colocated(llama_dir, [PROMPT], GREEDY)[0]
    pair.assert_clean()


# ---- late writes and commits of a released reservation (a client gone mid-handoff) ----------

@pytest.mark.parametrize("kv_transport", ["tcp", "tcp-stream"])
def test_late_kv_and_commit_of_an_aborted_reservation_are_refused_as_cancelled(
        make_pair: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The client goes away mid-handoff: decode releases the reservation on the frontend's abort,
    then prefill's blocks and commit (already under way) arrive. Nothing of them lands and the
    pages stay free; they are counted as `cancelled` and logged at INFO, not as an unauthorized or
    unknown transfer (the alarms a forged transfer raises, below)."""
    pair = make_pair()
    handoff = pair.reserve(PROMPT, GREEDY)
    assert handoff.reserved is not None
    transfer_id = handoff.reserved.transfer_id
    pair.to_decode.send(AbortMsg(handoff.request_id, "alice", "client_disconnected"))
    pair.pump(lambda: handoff.is_terminal, "the release")
    assert handoff.final.finish_reason == "abort" and pair.decode.engine.kv.num_used_pages == 0
    pool = pair.decode.engine.kv.pool
    before = [t.clone() for t in pool.k + pool.v]
    num_late = 2 * NUM_LAYERS + 1  # a block per layer and K/V, then the commit
    with caplog.at_level(logging.INFO, logger="kvseal.disagg"):
        rogue_push(pair, handoff, [30, 30])
        rogue_commit(pair, handoff, 30, [30, 30])
        stats = pair.decode.link.stats
        pair.pump(lambda: sum(stats().handoff_failures.values()) == 1 + num_late, "the late blocks and commit")
    assert pair.decode.link.stats().handoff_failures == {"aborted": 1, CANCELLED: num_late}
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k + pool.v)), "a late write landed"
    late = [r for r in caplog.records if transfer_id in r.getMessage()]
    assert len(late) == num_late and all(r.levelno == logging.INFO for r in late), [r.getMessage() for r in late]
    assert handoff.token_ids == []
    pair.assert_clean()


# the drain of a NIXL release that hears nothing of prefill: far past every bounded wait here, so
# a reservation freed within one was freed by the frontend's word that no prefill engine has it
NEVER_DRAINED_S = 600.0


@TRANSPORTS
def test_a_reservation_prefill_was_never_asked_for_is_freed_at_once(make_pair: Any) -> None:
    """The client left before the frontend sent `PrefillMsg` (before decode's `ReservedMsg` came
    back): the frontend's `AbortUnsentMsg` says no prefill engine has the transfer, so decode frees
    the reservation at once, over NIXL too, whose release otherwise waits for writes that might
    still land. A write and commit that come anyway are refused as after any release: nothing of
    them lands, they count as `cancelled`."""
    pair = make_pair(transfer_drain_s=NEVER_DRAINED_S)
    handoff = pair.reserve(PROMPT, GREEDY)
    pair.to_decode.send(AbortUnsentMsg(handoff.request_id, "alice", "client_disconnected"))
    pair.pump(lambda: handoff.is_terminal, "the release")
    assert (handoff.final.finish_reason, handoff.final.error) == ("abort", "client_disconnected")
    assert pair.decode.engine.kv.num_used_pages == 0 and pair.decode.steps.num_reservations() == 0
    pool = pair.decode.engine.kv.pool
    before = [t.clone() for t in pool.k + pool.v]
    rogue_push(pair, handoff, [30, 30])
    rogue_commit(pair, handoff, 30, [30, 30])
    # NIXL's late WRITE lands in free arena pages, never imported; the other transports count each block
    num_late = 1 if pair.decode.config.kv_transport == "nixl" else 2 * NUM_LAYERS + 1
    pair.pump(lambda: failures(pair).get(CANCELLED, 0) == num_late, "the late blocks and commit")
    assert failures(pair) == {"aborted": 1, CANCELLED: num_late}
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k + pool.v)), "a late write landed"
    assert handoff.token_ids == []
    pair.assert_clean()


@pytest.mark.parametrize("kv_transport", [NIXL])
def test_a_reservation_already_releasing_keeps_its_first_end(make_pair: Any) -> None:
    """Over NIXL a plain abort leaves the reservation releasing (a write may still land). A later
    abort does not replace its end: the frontend's `AbortUnsentMsg` for the `ReservedMsg` that came
    back after the client left frees it at once, and the end reported is the client's leaving,
    counted once."""
    pair = make_pair(transfer_drain_s=NEVER_DRAINED_S)
    handoff = pair.reserve(PROMPT, GREEDY)
    pair.to_decode.send(AbortMsg(handoff.request_id, "alice", "client_disconnected"))
    pair.pump(lambda: handoff.request_id in pair.decode.steps._pending_errors, "the deferred release")
    pair.to_decode.send(AbortUnsentMsg(handoff.request_id, "alice", RESERVATION_UNCLAIMED))
    pair.pump(lambda: handoff.is_terminal, "the release")
    assert (handoff.final.finish_reason, handoff.final.error) == ("abort", "client_disconnected")
    assert failures(pair) == {"aborted": 1}
    pair.assert_clean()


@pytest.mark.parametrize("kv_transport", [NIXL])
def test_only_the_frontend_that_reserved_can_say_prefill_was_never_asked(make_pair: Any) -> None:
    """Another frontend's `AbortUnsentMsg` is a plain abort: it cannot know what the reserving
    frontend sent to prefill, so over NIXL the release still waits for prefill's word (here its
    transfer abort), and the end is that abort's."""
    pair = make_pair(transfer_drain_s=NEVER_DRAINED_S)
    handoff = pair.reserve(PROMPT, GREEDY)
    other = TestFrontend(pair.ctx, pair.decode.config.listen, pair.keys.frontend, pair.keys.decode.public)
    try:
        other.send(AbortUnsentMsg(handoff.request_id, "alice", "client_disconnected"))
        pair.pump(lambda: handoff.request_id in pair.decode.steps._pending_errors, "the deferred release")
        for _ in range(50):
            pair.decode.loop.run_once(idle_poll_ms=1)
        assert not handoff.is_terminal and pair.decode.engine.kv.num_used_pages > 0
        rogue_abort(pair, handoff)  # prefill's last word: nothing more of the transfer will land
        pair.pump(lambda: handoff.is_terminal, "the release")
        assert handoff.final.error == "client_disconnected"
    finally:
        other.socket.close(linger=0)
    pair.assert_clean()


def test_a_commit_for_a_transfer_never_reserved_still_raises_the_alarm(
        make_pair: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Only a released reservation's own commit (its request id and tenant) is `cancelled`: one
    naming a transfer decode never reserved, or a released transfer under another identity, is
    counted as `unknown_transfer` and logged at ERROR."""
    pair = make_pair()
    released = pair.reserve(PROMPT, GREEDY)
    pair.to_decode.send(AbortMsg(released.request_id, "alice", "client_disconnected"))
    pair.pump(lambda: released.is_terminal, "the release")
    with caplog.at_level(logging.INFO, logger="kvseal.disagg"):
        rogue_commit(pair, released, 30, [30, 30], transfer_id="f" * 32)  # an id decode never drew
        rogue_commit(pair, released, 30, [30, 30], tenant="mallory")  # the released id, another tenant
        pair.pump(lambda: pair.decode.link.stats().handoff_failures.get("unknown_transfer", 0) == 2, "the refusals")
    assert pair.decode.link.stats().handoff_failures == {"aborted": 1, "unknown_transfer": 2}
    refusals = [r for r in caplog.records if "commit" in r.getMessage()]
    assert len(refusals) == 2 and all(r.levelno == logging.ERROR for r in refusals)
    pair.assert_clean()


# ---- commits and aborts that are not the reservation's own ----------------------------------

def rogue_abort(pair: PdPair, handoff: Handoff, tenant: str = "alice", transfer_id: str | None = None) -> None:
    r = handoff.reserved
    assert r is not None
    pair.peer_link().send(TransferAbortMsg(r.transfer_id if transfer_id is None else transfer_id,
                                           handoff.request_id, tenant, TRANSFER_FAILED, "forged", None, 502, "rogue"))


def failures(pair: PdPair) -> dict[str, int]:
    return dict(pair.decode.link.stats().handoff_failures)


@pytest.mark.parametrize("kv_transport", ["tcp", "tcp-stream"])
def test_a_commit_under_another_tenant_raises_the_alarm_and_the_real_commit_still_completes(
        make_pair: Any, llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A peer's commit for a live transfer under another tenant, sent before any KV: counted as
    `identity_mismatch` and logged at ERROR at once, and the reservation is untouched, so the
    real prefill's handoff completes. On tcp-stream it was parked before the identity check:
    no alarm, and 30 s later an expiry that blamed prefill."""
    pair = make_pair()
    handoff = pair.reserve(PROMPT, GREEDY)
    with caplog.at_level(logging.INFO, logger="kvseal.disagg"):
        rogue_commit(pair, handoff, 30, [30, 30], tenant="bob")
        pair.pump(lambda: failures(pair).get("identity_mismatch", 0) == 1, "the alarm")
    alarms = [r for r in caplog.records if "refused a commit" in r.getMessage()]
    assert len(alarms) == 1 and alarms[0].levelno == logging.ERROR
    pair.to_prefill.send(pair.prefill_msg(handoff, PROMPT, GREEDY))
    pair.wait(handoff)
    assert handoff.token_ids == colocated(llama_dir, [PROMPT], GREEDY)[0]
    assert failures(pair) == {"identity_mismatch": 1}
    pair.assert_clean()


@pytest.mark.parametrize("kv_transport", ["tcp-stream"])
def test_the_first_parked_commit_stands_and_a_second_is_an_alarm(
        make_pair: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Prefill commits a transfer once. Two commits held for the same data: the first decides,
    the second is refused as `duplicate_commit` (ERROR) and replaces nothing (it did: the parked
    commits were keyed by transfer id, so the last one won, silently)."""
    pair = make_pair()
    handoff = pair.reserve(PROMPT, GREEDY)
    with caplog.at_level(logging.INFO, logger="kvseal.disagg"):
        rogue_commit(pair, handoff, 30, [30, 30], first_token=5)  # no KV yet: held until the stream's end
        rogue_commit(pair, handoff, 30, [30, 30], first_token=6)
        pair.pump(lambda: failures(pair).get("duplicate_commit", 0) == 1, "the alarm")
    alarms = [r for r in caplog.records if "second commit" in r.getMessage()]
    assert len(alarms) == 1 and alarms[0].levelno == logging.ERROR
    rogue_push(pair, handoff, [30, 30])
    pair.pump(lambda: handoff.is_terminal, "the handoff")
    assert handoff.final.finish_reason == "length" and handoff.token_ids[0] == 5
    assert failures(pair) == {"duplicate_commit": 1}
    pair.assert_clean()


def test_a_transfer_abort_no_reservation_matches_raises_the_alarm(
        make_pair: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A transfer abort for an id decode never drew is `unknown_transfer`, for a live transfer
    under another tenant `identity_mismatch` (both ERROR, the reservation untouched); prefill's
    own abort of a reservation decode already released is `cancelled` (INFO). Forged aborts were
    dropped without a count or a line."""
    pair = make_pair()
    live, released = pair.reserve(PROMPT, GREEDY), pair.reserve(PROMPT, GREEDY)
    pair.to_decode.send(AbortMsg(released.request_id, "alice", "client_disconnected"))
    pair.pump(lambda: released.is_terminal, "the release")
    with caplog.at_level(logging.INFO, logger="kvseal.disagg"):
        rogue_abort(pair, live, transfer_id="f" * 32)
        rogue_abort(pair, live, tenant="mallory")
        rogue_abort(pair, released)
        pair.pump(lambda: sum(failures(pair).values()) == 4, "the refusals")
    assert failures(pair) == {"aborted": 1, "unknown_transfer": 1, "identity_mismatch": 1, CANCELLED: 1}
    levels = [r.levelno for r in caplog.records if "transfer abort" in r.getMessage()]
    assert sorted(levels) == [logging.INFO, logging.ERROR, logging.ERROR]
    pair.to_prefill.send(pair.prefill_msg(live, PROMPT, GREEDY))  # the live reservation is intact
    pair.wait(live)
    assert live.final.finish_reason == "length"
    pair.assert_clean()


# ---- the incident's placeholder path, in prefill --------------------------------------------

def _placeholder_victim(pair: PdPair, secret: list[int], skip_verify: bool) -> Handoff:
    pair.generate(secret, GREEDY, tenant="alice")  # decode's pages now hold alice's KV
    faults = [Fault.PLACEHOLDER_PREFILL, Fault.BYPASS_KV_CHECKS] + ([Fault.SKIP_HANDOFF_VERIFY] if skip_verify else [])
    with contextlib.ExitStack() as stack:
        for fault in faults:
            stack.enter_context(inject(fault))
        return pair.generate(PROMPT, GREEDY, tenant="bob")


@TRANSPORTS
def test_decode_verification_catches_the_placeholder_prefill(make_pair: Any) -> None:
    pair = make_pair()
    victim = _placeholder_victim(pair, list(range(300, 340)), skip_verify=False)
    assert_refused_by_decode(victim, "layer 0 K: only positions [0, 0)")
    pair.assert_clean()


@TRANSPORTS
def test_prefill_own_isolation_check_reaches_the_client_as_such(make_pair: Any) -> None:
    """With the checks on, prefill's own coverage check refuses the placeholder's forward: decode
    ends the request with prefill's code (isolation_check_failed), not as a plain abort or rejection."""
    pair = make_pair()
    with inject(Fault.PLACEHOLDER_PREFILL):
        victim = pair.generate(PROMPT, GREEDY, tenant="bob")
    assert_refused_by_decode(victim, "isolation check failed")
    assert victim.rejected is None
    assert isinstance(victim.prefill_result, PrefillRefusedMsg)
    assert victim.prefill_result.code == ISOLATION_CHECK_FAILED
    assert pair.prefill.link.stats().engine.num_isolation_violations == 1, "PD engines report their checks"
    assert pair.prefill.link.stats().handoff_failures == {ISOLATION_CHECK_FAILED: 1}
    pair.assert_clean()


def test_without_decode_verification_the_placeholder_leaks(make_pair: Any) -> None:
    """The negative control: switch the verification off and bob's answer depends on alice's prompt."""
    leaked_a = _placeholder_victim(make_pair(), list(range(300, 340)), skip_verify=True)
    leaked_b = _placeholder_victim(make_pair(), list(range(400, 440)), skip_verify=True)
    assert leaked_a.final.finish_reason == "length" and leaked_b.final.finish_reason == "length"
    assert leaked_a.token_ids != leaked_b.token_ids


# ---- reservations end only under the release rule ------------------------------------------

@TRANSPORTS
def test_a_reservation_without_commit_expires_and_is_released(make_pair: Any) -> None:
    pair = make_pair(reservation_timeout_s=0.3)
    handoff = pair.reserve(PROMPT, GREEDY)
    assert pair.decode.engine.kv.num_used_pages == len(handoff.reserved.pages)  # type: ignore[union-attr]
    pair.pump(lambda: handoff.is_terminal, "the expiry")
    assert_refused_by_decode(handoff, "no sign of the prefill engine", HANDOFF_FAILED)
    assert pair.decode.link.stats().num_reservations_expired == 1
    pair.assert_clean()


def test_reserved_pages_are_never_preempted(make_pair: Any, llama_dir: Path) -> None:
    """A running request that needs more pages than are free is preempted itself; the pages of
    a reservation waiting for its KV are never taken, and both requests still finish correctly."""
    pair = make_pair(decode=dict(kv_cache_tokens=64, max_model_len=64))  # 16 pages of 4
    long_params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    a_prompt, b_prompt = list(range(10, 30)), list(range(60, 84))
    a = pair.generate_start(a_prompt, long_params)
    b = pair.reserve(b_prompt, GREEDY)  # 7 pages, while a holds 6 and must grow to 15
    assert b.reserved is not None
    pair.pump(lambda: pair.decode.engine.stats().num_preemptions > 0, "a's preemption")
    assert pair.decode.engine.kv.allocator.pages_of(b.request_id) == b.reserved.pages
    pair.to_prefill.send(pair.prefill_msg(b, b_prompt, GREEDY))
    pair.wait(b)
    pair.wait(a)
    assert b.token_ids == colocated(llama_dir, [b_prompt], GREEDY)[0]
    assert a.token_ids == colocated(llama_dir, [a_prompt], long_params)[0]
    pair.assert_clean()


def test_a_reservation_waits_for_pages_instead_of_taking_any(make_pair: Any) -> None:
    pair = make_pair(decode=dict(kv_cache_tokens=64, max_model_len=64))
    first = pair.reserve(list(range(10, 50)), GREEDY)  # 11 of 16 pages
    second = pair.reserve(list(range(60, 90)), GREEDY, wait=False)  # needs 8: waits
    pair.pump(lambda: pair.decode.engine.kv.num_free_pages == 5, "the first reservation")
    assert second.reserved is None
    pair.to_prefill.send(pair.prefill_msg(first, list(range(10, 50)), GREEDY))
    pair.wait(first)
    pair.pump(lambda: second.reserved is not None, "the second reservation")
    pair.to_prefill.send(pair.prefill_msg(second, list(range(60, 90)), GREEDY))
    pair.wait(second)
    assert first.final.finish_reason == second.final.finish_reason == "length"
    pair.assert_clean()


@TRANSPORTS
def test_client_abort_during_the_handoff_cleans_both_sides(make_pair: Any) -> None:
    pair = make_pair()
    handoff = pair.reserve(PROMPT, GREEDY)
    pair.to_prefill.send(pair.prefill_msg(handoff, PROMPT, GREEDY))
    pair.to_prefill.send(AbortMsg(handoff.request_id, "alice", "client_disconnected"))
    pair.to_decode.send(AbortMsg(handoff.request_id, "alice", "client_disconnected"))
    pair.pump(lambda: handoff.is_terminal and handoff.prefill_result is not None, "both sides")
    # Whichever side sees the abort first ends the request: decode with an aborted output, or
    # prefill's refusal (the frontend's rejection) before decode has sent any output.
    assert handoff.rejected is not None or handoff.final.finish_reason == "abort"
    pair.pump(lambda: pair.decode.engine.kv.num_used_pages == 0 and pair.prefill.engine.kv.num_used_pages == 0,
              "the pages")
    pair.assert_clean()


@TRANSPORTS
def test_transport_error_reaches_the_frontend_and_frees_prefill(make_pair: Any) -> None:
    pair = make_pair()
    handoff = pair.reserve(PROMPT, GREEDY)
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there: connection refused
    msg = pair.prefill_msg(handoff, PROMPT, GREEDY)
    pair.to_prefill.send(type(msg)(**{**{f: getattr(msg, f) for f in msg.__struct_fields__},
                                     "kv_address": dead, "decode_address": dead}))
    pair.pump(lambda: handoff.prefill_result is not None, "prefill's report")
    assert isinstance(handoff.prefill_result, PrefillRefusedMsg)
    assert handoff.prefill_result.code == "kv_transfer_failed"
    pair.to_decode.send(AbortMsg(handoff.request_id, "alice", "prefill failed"))  # what the frontend does
    pair.pump(lambda: handoff.is_terminal, "decode's release")
    assert handoff.final.finish_reason == "abort"
    pair.assert_clean()


def test_an_engine_binds_only_its_address_and_refuses_a_taken_one(make_pair: Any) -> None:
    pair = make_pair()
    with pytest.raises(ConfigError, match="cannot listen on"):
        EngineNode(pair.decode.engine, NodeConfig("decode", pair.decode.config.listen, link_keys=pair.keys.of_decode()))
    pair.assert_clean()


def test_an_uncompilable_grammar_is_refused_by_decode_before_it_reserves(make_pair: Any) -> None:
    pair = make_pair()
    params = SamplingParams(max_tokens=4, temperature=0, structured=StructuredOutput("json_schema", '{"type": 5}'))
    handoff = pair.reserve(PROMPT, params)
    assert handoff.refused is not None and handoff.refused.http_status == 400, handoff
    assert handoff.refused.param == "response_format"
    pair.assert_clean()


@needs_nixl
def test_a_nixl_write_into_another_reservations_slots_is_refused(llama_dir: Path, loaded: Any) -> None:
    """NIXL lets a peer write anywhere in decode's registered arena; decode takes a transfer's
    arena pages only if every one carries that transfer's tag. A broken prefill writes transfer
    B's KV into A's arena pages (through A's address) and names B: decode refuses B's landing
    (B's own arena pages are untagged), B's commit is refused, and A, written correctly
    afterwards, still runs."""
    pair = PdPair(args(llama_dir), args(llama_dir), loaded=loaded, kv_transport="nixl")
    try:
        a, b = pair.reserve(PROMPT, GREEDY), pair.reserve(PROMPT, GREEDY)
        ra, rb = a.reserved, b.reserved
        assert ra is not None and rb is not None
        sender, pool = pair.prefill.transport, pair.prefill.engine.kv.pool
        src = list(range(len(rb.pages)))
        sender.push(pair.plan(rb, src, [30, 30], ra.kv_address, dest=ra.pages), pool)  # type: ignore[union-attr]
        rogue_commit(pair, b, 30, [30, 30])
        pair.pump(lambda: b.is_terminal, "b's refusal")
        assert_refused_by_decode(b, "layer 0 K: only positions [0, 0)")
        assert pair.decode.transport.num_refused == 1  # type: ignore[union-attr]
        rogue_push(pair, a, [30, 30])
        rogue_commit(pair, a, 30, [30, 30])
        pair.pump(lambda: a.is_terminal, "a")
        assert a.final.finish_reason == "length" and a.final.error is None
        pair.assert_clean()
    finally:
        pair.close()


# ---- the transports' own guarantees (what leaves prefill's pool, when it may be reused) ---------

STALE = 12345.0  # what an earlier owner left in prefill's pool past the written positions


def positions(pool: Any, layer: int, kind: str, pages: list[int]) -> torch.Tensor:
    """K or V of `pages` (position order) of one layer: [num_kv_heads, len(pages) * page_size, head_dim]."""
    source = pool.k[layer] if kind == "k" else pool.v[layer]
    part = source[:, torch.tensor(pages)]
    return part.reshape(part.shape[0], -1, part.shape[-1]).clone()


def prefill_pages_with_stale_tails(pair: PdPair, num_pages: int, num_written: int) -> list[int]:
    """Prefill pages (reversed, so no two are consecutive in position order) holding random KV,
    and STALE past `num_written` positions."""
    pool, page_size = pair.prefill.engine.kv.pool, pair.prefill.engine.kv.pool.page_size
    pages = list(range(num_pages))[::-1]
    for tensor in pool.k + pool.v:
        tensor.normal_()
        last = tensor[:, pages[-1]]
        last[num_written - (num_pages - 1) * page_size:] = STALE
    return pages


def push_and_land(pair: PdPair, handoff: Handoff, src: list[int], written: list[int], start: int = 0,
                  sender: Any = None) -> int:
    r = handoff.reserved
    assert r is not None
    kv_address = pair.decode.transport.address_for(r.transfer_id)  # type: ignore[union-attr]  # as authorized now
    plan = pair.plan(r, src, written, kv_address, start=start)
    if sender is None:
        sender = TcpSender(pair.rogue) if pair.prefill.config.kv_transport == "tcp" else pair.prefill.transport
    num_bytes = sender.push(plan, pair.prefill.engine.kv.pool)  # type: ignore[union-attr]
    receiver = pair.decode.transport

    def landed() -> bool:
        landing = receiver.landed(r.transfer_id)  # type: ignore[union-attr]
        return landing is not None and all(landing.covered_prefix(layer, kind) >= end or (start and landing.ranges[
            (layer, kind)] == [(start, end)]) for layer, end in enumerate(written) for kind in ("k", "v"))

    pair.pump(landed, "the landing")
    return num_bytes


@TRANSPORTS
def test_prefill_may_reuse_its_pages_as_soon_as_push_returns(make_pair: Any) -> None:
    """Whatever the sender reads from prefill's pool it has read when `push` returns: pages
    overwritten right after (freed and reused by another request) never change what lands."""
    pair = make_pair()
    handoff = pair.reserve(PROMPT, GREEDY)
    src = prefill_pages_with_stale_tails(pair, 8, 30)
    pool = pair.prefill.engine.kv.pool
    sent = {(layer, kind): positions(pool, layer, kind, src)[:, :30] for layer in range(NUM_LAYERS) for kind in "kv"}
    r = handoff.reserved
    assert r is not None
    plan = pair.plan(r, src, [30, 30])
    sender = TcpSender(pair.rogue) if pair.prefill.config.kv_transport == "tcp" else pair.prefill.transport
    sender.push(plan, pool)  # type: ignore[union-attr]
    for tensor in pool.k + pool.v:
        tensor.fill_(-1.0)  # the pages are reused at once
    rogue_commit(pair, handoff, 30, [30, 30])
    pair.pump(lambda: bool(handoff.outputs) or handoff.is_terminal, "the first token")
    assert handoff.final.error is None, handoff.final
    decode_pool = pair.decode.engine.kv.pool
    for (layer, kind), expected in sent.items():
        assert torch.equal(positions(decode_pool, layer, kind, r.pages)[:, :30], expected), (layer, kind)
    pair.pump(lambda: handoff.is_terminal, "the end")
    pair.assert_clean()


@pytest.mark.parametrize("max_frame_runs", [0, 8])
def test_no_stale_bytes_leave_prefills_pool_over_tcp(make_pair: Any, max_frame_runs: int) -> None:
    """What goes on the wire past the written positions is zeros, not the pool's old content,
    whether the pages are sent from the pool in place or gathered first."""
    pair = make_pair()
    src = prefill_pages_with_stale_tails(pair, 8, 30)
    ctx = pair.ctx
    router = ctx.socket(zmq.ROUTER)  # stands in for decode: proves decode's key (no ZAP: any client may connect)
    router.curve_server, router.curve_secretkey = True, pair.keys.decode.secret
    port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        links = PeerLinks(ctx, pair.keys.prefill)
        plan = PushPlan("t-1", src, [30, 30], f"127.0.0.1:{port}", list(range(8)), transfer_key=bytes(32),
                        decode_key=pair.keys.decode.public)
        num_bytes = TcpSender(links, max_frame_runs=max_frame_runs).push(plan, pair.prefill.engine.kv.pool)
        frames = [router.recv_multipart() for _ in range(2 * NUM_LAYERS)]
        links.close()
    finally:
        router.close(0)
    assert sum(len(part) for f in frames for part in f[2:]) == num_bytes
    for _, header, *parts in frames:
        assert len(parts) == (1 if max_frame_runs == 0 else 2 * 8)  # gathered: one frame; else per head and page
        data = torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.float32)
        assert not (data == STALE).any(), decode(header)
        num_kv_heads, _, head_dim = pair.prefill.engine.kv.pool.page_shape()
        staged = data.view(num_kv_heads, -1, head_dim)  # [num_kv_heads, positions, head_dim]
        assert torch.count_nonzero(staged[:, 30:]) == 0


@TRANSPORTS
def test_only_the_written_positions_land_and_the_tail_is_zero(make_pair: Any) -> None:
    pair = make_pair(decode=dict(kv_cache_tokens=1024))  # decode's pool (and NIXL arena) larger than prefill's
    handoff = pair.reserve(PROMPT, GREEDY)
    r = handoff.reserved
    assert r is not None
    decode_pool = pair.decode.engine.kv.pool
    decode_pool.fill(r.pages, STALE)  # what decode's pages held before
    src = prefill_pages_with_stale_tails(pair, 8, 30)
    push_and_land(pair, handoff, src, [30, 30])
    for layer in range(NUM_LAYERS):
        for kind in "kv":
            got = positions(decode_pool, layer, kind, r.pages)
            assert torch.equal(got[:, :30], positions(pair.prefill.engine.kv.pool, layer, kind, src)[:, :30])
            assert torch.count_nonzero(got[:, 30:32]) == 0, "the last page's tail must be zeros"
    if pair.prefill.config.kv_transport == "nixl":  # nothing stale reached decode's arena either
        assert not (pair.decode.transport._arena.view(torch.float32) == STALE).any()  # type: ignore[union-attr]
    pair.to_decode.send(AbortMsg(handoff.request_id, "alice", "done"))
    pair.pump(lambda: handoff.is_terminal, "the release")
    pair.assert_clean()


@TRANSPORTS
def test_a_push_from_a_page_aligned_start_sends_only_start_to_end(make_pair: Any) -> None:
    """PushPlan.start (positions before it are decode's already, e.g. a prefix-cache hit): only
    [start, end) is sent and lands; decode's earlier positions are untouched."""
    pair = make_pair()
    handoff = pair.reserve(PROMPT, GREEDY)
    r = handoff.reserved
    assert r is not None
    decode_pool = pair.decode.engine.kv.pool
    decode_pool.fill(r.pages, STALE)
    src = prefill_pages_with_stale_tails(pair, 8, 30)
    page_size = decode_pool.page_size
    # as decode authorizes a reservation whose first two pages are its prefix-cache hit
    pair.decode.transport.authorize(r.transfer_id, list(r.pages[8 // page_size:]), start=8,  # type: ignore[union-attr]
                                    key=r.transfer_key)
    num_bytes = push_and_land(pair, handoff, src, [30, 30], start=8)
    num_kv_heads, _, head_dim = decode_pool.page_shape()
    payload = NUM_LAYERS * 2 * num_kv_heads * 6 * page_size * head_dim * 4  # pages 2..7, float32
    # tcp and tcp-stream send exactly the payload; NIXL's slots also carry each page's transfer tag
    if pair.prefill.config.kv_transport == "nixl":
        assert payload < num_bytes < 2 * payload
    else:
        assert num_bytes == payload
    landing = pair.decode.transport.landed(r.transfer_id)  # type: ignore[union-attr]
    assert landing is not None
    assert dict(landing.ranges) == {(layer, kind): [(8, 30)] for layer in range(NUM_LAYERS) for kind in "kv"}
    for layer in range(NUM_LAYERS):
        for kind in "kv":
            got = positions(decode_pool, layer, kind, r.pages)
            assert (got[:, :8] == STALE).all(), "positions before start are not decode's to overwrite"
            assert torch.equal(got[:, 8:30], positions(pair.prefill.engine.kv.pool, layer, kind, src)[:, 8:30])
            assert torch.count_nonzero(got[:, 30:32]) == 0
    pair.to_decode.send(AbortMsg(handoff.request_id, "alice", "done"))
    pair.pump(lambda: handoff.is_terminal, "the release")
    pair.assert_clean()


def assert_landed_exactly(pair: PdPair, handoff: Handoff, src: list[int], num_written: int) -> None:
    """Decode's pages hold prefill's positions [0, num_written) of `src`, zeros after them."""
    r = handoff.reserved
    assert r is not None
    for layer in range(NUM_LAYERS):
        for kind in "kv":
            got = positions(pair.decode.engine.kv.pool, layer, kind, r.pages)
            want = positions(pair.prefill.engine.kv.pool, layer, kind, src)
            assert torch.equal(got[:, :num_written], want[:, :num_written]), (layer, kind)
            assert torch.count_nonzero(got[:, num_written:]) == 0, "the last page's tail must be zeros"


@pytest.mark.parametrize("max_direct_runs", [0, 64])
@needs_nixl
def test_nixl_lands_the_same_kv_read_from_the_pool_in_place_or_gathered(llama_dir: Path, loaded: Any,
                                                                       max_direct_runs: int) -> None:
    """Prefill's pages in 8 runs: read in place (up to 64 runs allowed) or gathered into staging
    first (none allowed); either way exactly the written positions land, nothing stale leaves."""
    pair = PdPair(args(llama_dir), args(llama_dir), loaded=loaded, kv_transport="nixl")
    sender = NixlSender(f"test-sender-{max_direct_runs}-{free_port()}", "127.0.0.1",
                        max_direct_runs=max_direct_runs)
    try:
        handoff = pair.reserve(PROMPT, GREEDY)
        pair.decode.engine.kv.pool.fill(list(handoff.reserved.pages), STALE)  # type: ignore[union-attr]
        src = prefill_pages_with_stale_tails(pair, 8, 30)
        push_and_land(pair, handoff, src, [30, 30], sender=sender)
        assert sender.num_staged_pushes == (1 if max_direct_runs == 0 else 0)
        assert_landed_exactly(pair, handoff, src, 30)
        assert not (pair.decode.transport._arena.view(torch.float32) == STALE).any()  # type: ignore[union-attr]
        pair.to_decode.send(AbortMsg(handoff.request_id, "alice", "done"))
        pair.pump(lambda: handoff.is_terminal, "the release")
        pair.assert_clean()
    finally:
        sender.close()
        pair.close()


@needs_nixl
def test_nixl_a_fragmented_arena_gives_a_transfer_several_runs_and_it_still_lands(llama_dir: Path,
                                                                                   loaded: Any) -> None:
    """With no run of free arena pages long enough, a transfer gets the lowest free ones (its
    address names every run); the push lands all the same, and the arena pages come back once
    the transfer is over."""
    pair = PdPair(args(llama_dir), args(llama_dir), loaded=loaded, kv_transport="nixl")
    try:
        free = pair.decode.transport._free  # type: ignore[union-attr]
        held = free.take(free.num_free)
        holes = held[:16:2]  # 8 free arena pages, no two consecutive
        free.give_back(holes)
        handoff = pair.reserve(PROMPT, GREEDY)
        r = handoff.reserved
        assert r is not None
        address = decode_address(pair.decode.transport.address_for(r.transfer_id))  # type: ignore[union-attr]
        assert address.arena_pages() == holes and len(address.arena_runs) == 8
        src = prefill_pages_with_stale_tails(pair, 8, 30)
        push_and_land(pair, handoff, src, [30, 30])
        assert_landed_exactly(pair, handoff, src, 30)
        assert free.num_free == 0
        pair.to_decode.send(AbortMsg(handoff.request_id, "alice", "done"))
        pair.pump(lambda: handoff.is_terminal, "the release")
        assert free.num_free == 8
        free.give_back([page for page in held if page not in holes])
        pair.assert_clean()
    finally:
        pair.close()


def test_tcp_gathered_pages_land_exactly(make_pair: Any) -> None:
    """Scattered prefill pages gathered into one frame per message (no runs allowed in place)
    land as the written positions, zeros after them; twice, through the reused gather buffer."""
    pair = make_pair()
    sender = TcpSender(pair.rogue, max_frame_runs=0)
    for _ in range(2):
        handoff = pair.reserve(PROMPT, GREEDY)
        pair.decode.engine.kv.pool.fill(list(handoff.reserved.pages), STALE)  # type: ignore[union-attr]
        src = prefill_pages_with_stale_tails(pair, 8, 30)
        push_and_land(pair, handoff, src, [30, 30], sender=sender)
        assert_landed_exactly(pair, handoff, src, 30)
        pair.to_decode.send(AbortMsg(handoff.request_id, "alice", "done"))
        pair.pump(lambda done=handoff: done.is_terminal, "the release")
    pair.assert_clean()


@needs_nixl
def test_nixl_arena_pages_stay_taken_until_no_write_can_land(llama_dir: Path, loaded: Any) -> None:
    """A cancelled transfer's arena pages go to no other transfer while a write of it could still
    land (no notification, no word from prefill); once prefill says it is done they do."""
    pair = PdPair(args(llama_dir), args(llama_dir), loaded=loaded, kv_transport="nixl", transfer_drain_s=600.0)
    try:
        receiver = pair.decode.transport
        free = receiver._free  # type: ignore[union-attr]
        before = free.num_free
        receiver.authorize("t-late", [0, 1, 2], key=bytes(32))  # type: ignore[union-attr]
        arena = decode_address(receiver.address_for("t-late")).arena_pages()  # type: ignore[union-attr]
        assert receiver.cancel("t-late") is False  # type: ignore[union-attr]
        receiver.authorize("t-next", [3, 4, 5], key=bytes(32))  # type: ignore[union-attr]
        assert not set(arena) & set(decode_address(receiver.address_for("t-next")).arena_pages())  # type: ignore[union-attr]
        assert free.num_free == before - 6
        receiver.sender_done("t-late")  # type: ignore[union-attr]
        assert receiver.cancel("t-late") is True  # type: ignore[union-attr]
        assert receiver.cancel("t-next") is False  # type: ignore[union-attr]
        receiver.sender_done("t-next")  # type: ignore[union-attr]
        assert receiver.cancel("t-next") is True  # type: ignore[union-attr]
        assert free.num_free == before
        pair.assert_clean()
    finally:
        pair.close()


def test_arena_pages_take_the_lowest_run_that_fits_else_the_lowest_free_pages() -> None:
    pages = ArenaPages(10)
    assert pages.take(3) == [0, 1, 2]
    assert pages.take(2) == [3, 4]
    pages.give_back([1])
    assert pages.take(2) == [5, 6]  # the hole at 1 is too short
    assert pages.take(1) == [1]
    pages.give_back([0, 2, 4])
    assert pages.take(4) == [0, 2, 4, 7]  # no run of 4: the lowest free pages
    with pytest.raises(AssertionError, match="twice"):
        pages.give_back([8])
    with pytest.raises(RuntimeError, match="free pages"):
        pages.take(3)
    assert pages.num_free == 2


@pytest.mark.parametrize("pages", [[5, 2, 3, 9], [4, 5, 6, 7]])
def test_tcp_frames_cut_anywhere_land_in_scattered_or_consecutive_pages(pages: list[int]) -> None:
    """Frames of whole pages cut at any page (across heads too) land at the reservation's pages,
    whether consecutive or not, positions past `end` zeroed, no other page touched."""
    pool = KVPool(2, 12, 4, 2, 3, torch.float32)
    receiver = TcpReceiver(pool, 2, "test")
    for tensor in pool.k + pool.v:
        tensor.fill_(STALE)
    receiver.authorize("t-1", pages, key=b"")  # frames ride the CURVE link: no key here
    sent = torch.randn(2, 4, 4, 3)  # [kv_heads, pages, page_size, head_dim], the positions in order
    raw = sent.view(-1).view(torch.uint8)
    page_bytes = 4 * 3 * 4
    cuts = [0, 1, 4, 6, 8]  # frames of 1, 3, 2 and 2 pages: the second crosses from head 0 to head 1
    frames = [memoryview(raw[a * page_bytes:b * page_bytes].numpy().tobytes()) for a, b in zip(cuts, cuts[1:])]
    assert receiver.deliver(KVBlockMsg("t-1", 1, "v", 0, 14), frames) is None
    got = pool.v[1][:, pages]
    assert torch.equal(got.reshape(2, 16, 3)[:, :14], sent.reshape(2, 16, 3)[:, :14])
    assert torch.count_nonzero(got.reshape(2, 16, 3)[:, 14:]) == 0
    others = [page for page in range(12) if page not in pages]
    assert (pool.v[1][:, others] == STALE).all() and all((t == STALE).all() for t in (*pool.k, pool.v[0]))
    assert receiver.deliver(KVBlockMsg("t-1", 1, "k", 0, 14), frames[:-1]) == "bad_block_size"


def test_tcp_receiver_refuses_a_cancelled_transfers_frame_as_cancelled_and_an_unknown_ones_as_unauthorized() -> None:
    pool = KVPool(2, 12, 4, 2, 3, torch.float32)
    for tensor in pool.k + pool.v:
        tensor.fill_(STALE)
    receiver = TcpReceiver(pool, 2, "test")
    receiver.authorize("t-1", [4, 5], key=b"")
    assert receiver.cancel("t-1") and receiver.cancel("never")
    frame = [memoryview(bytes(2 * 2 * 4 * 3 * 4))]  # [kv_heads, pages, page_size, head_dim], float32
    assert receiver.deliver(KVBlockMsg("t-1", 0, "k", 0, 8), frame) == CANCELLED
    assert receiver.deliver(KVBlockMsg("never", 0, "k", 0, 8), frame) == "unauthorized_transfer"
    assert all((t == STALE).all() for t in pool.k + pool.v), "a refused frame landed"


def test_recently_ended_transfers_are_bounded_forgetting_the_oldest_first() -> None:
    ended: RecentlyEnded[int] = RecentlyEnded(max_len=3)
    for number in range(5):
        ended.add(f"t-{number}", number)
    assert len(ended) == 3 and "t-0" not in ended and "t-1" not in ended
    assert [ended.get(f"t-{n}") for n in range(2, 5)] == [2, 3, 4]
    ended.add("t-2", 2)  # seen again: newest now, so t-3 is the next to go
    ended.add("t-5", 5)
    assert "t-3" not in ended and "t-2" in ended


def test_tcp_receiver_refuses_to_authorize_pages_outside_its_pool() -> None:
    receiver = TcpReceiver(KVPool(2, 12, 4, 2, 3, torch.float32), 2, "test")
    with pytest.raises(ValueError, match="outside the pool"):
        receiver.authorize("t-1", [3, 12], key=b"")


def test_a_push_plan_refuses_a_negative_start() -> None:
    with pytest.raises(ValueError, match="start"):
        PushPlan("t", [0], [4], "127.0.0.1:1", [0], start=-4, transfer_key=bytes(32), decode_key=b"")


def test_copy_pages_checks_page_ids_before_moving_a_byte() -> None:
    source = torch.arange(2 * 5 * 4 * 3, dtype=torch.float32).view(2, 5, 4, 3)
    target = torch.zeros(2, 6, 4, 3)
    copy_pages(target, [5, 0, 1, 3], source, [4, 2, 3, 0])
    for t, s in zip([5, 0, 1, 3], [4, 2, 3, 0]):
        assert torch.equal(target[:, t], source[:, s])
    before = target.clone()
    with pytest.raises(IndexError):
        copy_pages(target, [0, 6], source, [0, 1])
    with pytest.raises(IndexError):
        copy_pages(target, [0, 1], source, [-1, 1])
    assert torch.equal(target, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
@pytest.mark.parametrize("pages", [[3, 4, 5, 6], [9, 0, 4, 5, 2], list(range(0, 2 * MAX_MEMMOVE_RUNS + 4, 2))])
@pytest.mark.parametrize("page_shape", [(4, 5), ()], ids=["pages-of-rows", "one-element-pages"])
def test_zero_pages_zeroes_exactly_those_pages_of_every_row(dtype: torch.dtype, pages: list[int],
                                                            page_shape: tuple[int, ...]) -> None:
    """Consecutive, scattered, and more runs than it memsets one by one, of any dtype and page
    shape (a 2-D tensor too): torch's own indexed assignment is the reference, and ids are
    checked before a byte is written."""
    target = torch.randint(1, 100, (3, 2 * MAX_MEMMOVE_RUNS + 4, *page_shape)).to(dtype)
    want = target.clone()
    want[:, pages] = 0
    zero_pages(target, pages)
    assert torch.equal(target, want)
    before = target.clone()
    for bad in ([0, target.shape[1]], [-1, 1]):
        with pytest.raises(IndexError):
            zero_pages(target, bad)
        assert torch.equal(target, before)


@pytest.mark.parametrize(("num_layers", "num_parts"), [(30, 4), (24, 4), (5, 4), (2, 4), (1, 4), (32, 5), (7, 1)])
def test_nixl_parts_halve_and_cover_every_layer_once(num_layers: int, num_parts: int) -> None:
    sizes = part_sizes(num_layers, num_parts)
    assert sum(sizes) == num_layers and len(sizes) == min(num_layers, num_parts) and min(sizes) >= 1
    assert sizes == sorted(sizes, reverse=True)  # the last WRITE's copy-in, left after it lands, is the smallest
    if (num_layers, num_parts) == (30, 4):
        assert sizes == [16, 8, 4, 2]


def test_runs_memo_answers_for_the_lists_it_is_asked_about() -> None:
    """A memo of the last answer never answers for other lists, nor for a list changed in place."""
    runs = RunsMemo()
    a, b = [3, 4, 5, 9], [0, 1, 2, 3]
    assert runs(a, b) == joint_runs(a, b) == [(0, 3), (3, 1)]
    assert runs(a, [0, 1, 7, 8]) == [(0, 2), (2, 1), (3, 1)]
    a[1] = 7  # the caller's list changed: the memo kept a copy, not the list
    assert runs(a, b) == joint_runs(a, b) == [(0, 1), (1, 1), (2, 1), (3, 1)]
    source = torch.arange(2 * 5 * 4 * 3, dtype=torch.float32).view(2, 5, 4, 3)
    target = torch.zeros(2, 6, 4, 3)
    for pages in ([5, 0, 1], [2, 3, 4]):  # one memo over calls with different pages
        copy_pages(target, pages, source, [4, 2, 3], runs)
        assert all(torch.equal(target[:, t], source[:, s]) for t, s in zip(pages, [4, 2, 3]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sides", ["target_range", "source_range", "both_scattered"])
def test_copy_pages_with_many_runs_moves_exactly_the_named_pages(dtype: torch.dtype, sides: str) -> None:
    """Past MAX_MEMMOVE_RUNS runs `copy_pages` copies with numpy: the same result, every other
    page of the target untouched, out-of-range ids refused before a byte moves."""
    source = torch.randn(3, 60, 4, 5).to(dtype)
    target = torch.full((3, 50, 4, 5), STALE, dtype=dtype)
    scattered = list(range(0, 60, 3))[:20][::-1]  # 20 pages, no two consecutive
    target_pages = list(range(10, 30)) if sides == "target_range" else list(range(49, 9, -2))
    source_pages = list(range(20, 40)) if sides == "source_range" else scattered
    before = target.clone()
    copy_pages(target, target_pages, source, source_pages)
    expected = before.clone()
    expected[:, target_pages] = source[:, source_pages]
    assert torch.equal(target, expected)
    with pytest.raises(IndexError):
        copy_pages(target, [*target_pages[:-1], 50], source, source_pages)
    assert torch.equal(target, expected)


def test_a_commit_with_an_allowed_first_token_runs(make_pair: Any) -> None:
    """The control for the allowed_token_ids check: a first token from the set passes, and the
    request goes on sampling only from it."""
    pair = make_pair()
    handoff = pair.reserve(PROMPT, ALLOWED)
    rogue_push(pair, handoff, [30, 30])
    rogue_commit(pair, handoff, 30, [30, 30], first_token=7)
    pair.pump(lambda: handoff.is_terminal, "the request")
    assert handoff.final.finish_reason == "length" and set(handoff.token_ids) <= {7, 8}
    assert pair.decode.link.stats().handoff_failures == {}
    pair.assert_clean()


@needs_nixl
def test_a_nixl_reservation_the_client_left_ends_as_the_clients_abort_when_prefill_refuses_it(
        llama_dir: Path, loaded: Any) -> None:
    """Over NIXL decode's release of an aborted reservation waits for prefill's last word (a
    write could still land). When that word is prefill's refusal of the request, the end the
    frontend gets is the abort that came first (the client left), never prefill's refusal: relayed
    as a 500 `request_aborted`, it would read as the engine's rejection (and the server's failure,
    whose quota goes back). The refusal finds the reservation releasing and is taken as its late
    word; the deferred error is not kept afterwards."""
    pair = PdPair(args(llama_dir), args(llama_dir), loaded=loaded, kv_transport="nixl", transfer_drain_s=600.0)
    try:
        handoff = pair.reserve(PROMPT, GREEDY)
        pair.to_decode.send(AbortMsg(handoff.request_id, "alice", "client_disconnected"))
        pair.pump(lambda: handoff.request_id in pair.decode.steps._pending_errors, "the deferred release")
        assert not handoff.is_terminal
        reserved = handoff.reserved
        assert reserved is not None
        pair.peer_link().send(TransferAbortMsg(reserved.transfer_id, handoff.request_id, "alice", REQUEST_ABORTED,
                                               "prefill did not complete the request", None, 500, "prefill"))
        pair.pump(lambda: handoff.is_terminal, "the end of the request")
        assert handoff.rejected is None
        assert (handoff.final.finish_reason, handoff.final.error) == ("abort", "client_disconnected")
        assert not pair.decode.steps._pending_errors
        pair.assert_clean()
    finally:
        pair.close()


# ---- the reservation deadline: a prefill that stopped, never one that is slow ---------------

SLOW_PROMPT = list(range(100, 160))  # 60 tokens: 15 prefill steps in chunks of 4
SLOW_TURN_S = 0.2  # a slow prefill: this long between its steps


def _slow_pair(make_pair: Any, reservation_timeout_s: float = 0.5) -> PdPair:
    """A prefill of many chunked steps, keepalives every step, a short reservation deadline."""
    pair: PdPair = make_pair(prefill=dict(max_num_batched_tokens=4), reservation_timeout_s=reservation_timeout_s,
                             keepalive_interval_s=0.05)
    return pair


@TRANSPORTS
def test_a_slow_prefill_that_keeps_working_is_not_expired(make_pair: Any) -> None:
    """Decode's deadline restarts at each of prefill's keepalives: a prefill whose 15 steps come
    SLOW_TURN_S apart (six reservation timeouts in all) hands off and the request runs to its end."""
    pair = _slow_pair(make_pair)
    handoff = pair.reserve(SLOW_PROMPT, GREEDY)
    pair.to_prefill.send(pair.prefill_msg(handoff, SLOW_PROMPT, GREEDY))
    for _ in range(200):
        pair.pump(lambda: True, "one turn of both loops")
        if handoff.prefill_result is not None or handoff.is_terminal:
            break
        time.sleep(SLOW_TURN_S)
    pair.wait(handoff)
    assert isinstance(handoff.prefill_result, PrefillDoneMsg), handoff.prefill_result
    assert handoff.final.finish_reason == "length" and handoff.final.error is None, handoff.final
    assert pair.decode.link.stats().num_reservations_expired == 0
    pair.assert_clean()


def test_a_prefill_that_stops_is_expired_though_it_held_the_request(make_pair: Any) -> None:
    """Keepalives come only from a prefill engine whose loop runs: one that stops (hung, or its
    host gone) after it took the request is expired, and its late push is dropped as cancelled."""
    pair = _slow_pair(make_pair)
    handoff = pair.reserve(SLOW_PROMPT, GREEDY)
    pair.to_prefill.send(pair.prefill_msg(handoff, SLOW_PROMPT, GREEDY))
    pair.pump(lambda: pair.prefill.engine.kv.num_used_pages > 0, "prefill's first step")
    for _ in range(500):  # prefill stopped: only decode runs
        pair.decode.loop.run_once(idle_poll_ms=10)
        pair._route()
        if handoff.is_terminal:
            break
    assert_refused_by_decode(handoff, "no sign of the prefill engine", HANDOFF_FAILED)
    assert pair.decode.link.stats().num_reservations_expired == 1
    pair.pump(lambda: handoff.prefill_result is not None, "prefill's late end")  # it resumes: nothing lands
    pair.assert_clean()


def test_a_request_decode_ends_is_aborted_on_its_prefill_engine(make_pair: Any) -> None:
    """The real PD frontend over both engines: decode expires a reservation whose prefill stalled
    mid-prefill; the frontend, ending the request, tells prefill to abort it too. When prefill
    runs again it computes nothing more and pushes nothing: its pages are free, its job refused."""
    pair = _slow_pair(make_pair)

    async def turn(with_prefill: bool = True) -> None:
        if with_prefill:
            pair.prefill.loop.run_once(idle_poll_ms=1)
        pair.decode.loop.run_once(idle_poll_ms=1)
        await asyncio.sleep(0.005)  # the frontend's tasks route what the engines sent

    async def scenario() -> None:
        client = PdClient([EngineEndpoint(pair.prefill.config.listen, pair.keys.prefill.public)],
                          [EngineEndpoint(pair.decode.config.listen, pair.keys.decode.public)], "/tokenizer",
                          pair.keys.frontend)
        try:
            starting = asyncio.create_task(client.start(timeout_s=30))
            while not starting.done():
                await turn()
            starting.result()
            ends = Ends()
            client.submit(AddRequestMsg("r-stall", "alice", SLOW_PROMPT, params_to_msg(GREEDY)), ends)
            for _ in range(500):
                await turn()
                if pair.prefill.engine.kv.num_used_pages > 0:
                    break  # prefill is computing it
            for _ in range(500):  # prefill stalls; decode expires the reservation and reports it
                await turn(with_prefill=False)
                if ends.events:
                    break
            assert len(ends.events) == 1 and isinstance(ends.events[0], RequestOutputMsg), ends.events
            assert ends.events[0].error_code == HANDOFF_FAILED
            for _ in range(500):  # prefill runs again
                await turn()
                if not pair.prefill.engine.has_unfinished():
                    break
            stats = pair.prefill.link.stats()
            assert stats.num_transfers == 0, "prefill finished and pushed a request the frontend had ended"
            assert stats.handoff_failures == {REQUEST_ABORTED: 1}
            assert pair.prefill.engine.kv.num_used_pages == 0
        finally:
            await client.shutdown(timeout_s=0)

    asyncio.run(scenario())
    pair.pump(lambda: not pair.decode.steps.held(), "decode's release")
    pair.assert_clean()

