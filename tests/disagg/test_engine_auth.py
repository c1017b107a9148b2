"""I9 in one process: only authenticated peers talk to an engine. A rogue that reaches an
engine's port with no key, with a key of its own, or with a key the engine accepts only from a
prefill peer gets nothing: no hello answer, no reservation, no cached-token count, no
integrity report, no shutdown, and the engine goes on serving its frontend. The negative
controls switch each check off (test-only faults) and show the cross-tenant prefix-cache
oracle it stops: a stranger's reservation reads 112 cached tokens of alice's 113-token prompt.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from pd_harness import PdPair
from rogue import Rogue
from test_handoff import GREEDY, args

from kvseal._testing.faults import Fault, inject
from kvseal.disagg.link_keys import KeyPair
from kvseal.disagg.msgs import (
    AbortUnsentMsg,
    CommitMsg,
    EngineInfoMsg,
    HelloMsg,
    IntegrityCheckMsg,
    PdMsg,
    PdStatsMsg,
    ReservedMsg,
    ReserveMsg,
    WrittenRangeMsg,
)
from kvseal.disagg.node import EngineNode
from kvseal.messages.convert import params_to_msg
from kvseal.messages.msgs import AbortMsg, ShutdownMsg
from kvseal.models.loader import load_model

SECRET_PROMPT = [(7 * i) % 400 + 100 for i in range(113)]  # alice's; 113 tokens, pages of 4: 112 cacheable
WRONG_GUESS = [(11 * i) % 400 + 100 for i in range(113)]
ROGUES = ["no key", "its own key", "prefill's peer key"]
NUM_FLOOD = 20


@pytest.fixture(scope="module")
def loaded(llama_dir: Path) -> Any:
    return load_model(str(llama_dir), args(llama_dir).torch_dtype)


@pytest.fixture
def pair(llama_dir: Path, loaded: Any) -> Iterator[PdPair]:
    """Both engines, alice's secret prompt already served (so decode's prefix cache holds it)."""
    pd = PdPair(args(llama_dir), args(llama_dir), loaded=loaded)
    handoff = pd.generate(SECRET_PROMPT, GREEDY, tenant="alice")
    assert handoff.final.error is None, handoff.final
    yield pd
    pd.close()


def rogue_of(pair: PdPair, node: EngineNode, kind: str) -> Rogue:
    server_key = node.config.link_keys.own.public  # public: a rogue may know it
    own = {"no key": None, "its own key": KeyPair.ephemeral("mallory"), "prefill's peer key": pair.keys.prefill}[kind]
    return Rogue(node.config.listen, own, server_key)


def probe(prompt: list[int] = SECRET_PROMPT, request_id: str = "rogue-1") -> ReserveMsg:
    """What the oracle asks decode: reserve alice's prompt in alice's namespace (a public hash)."""
    return ReserveMsg(request_id, "alice", prompt, params_to_msg(GREEDY))


def frontend_msgs() -> list[PdMsg]:
    return [HelloMsg("rogue"), IntegrityCheckMsg(), probe(), AbortMsg("rogue-1", "alice", "rogue"),
            AbortUnsentMsg("rogue-1", "alice", "rogue"), ShutdownMsg("rogue")]


def pump_turns(pair: PdPair, num_turns: int = 100) -> None:
    for _ in range(num_turns):
        pair.prefill.loop.run_once(idle_poll_ms=1)
        pair.decode.loop.run_once(idle_poll_ms=1)


def assert_still_serves(pair: PdPair) -> None:
    """The engines were not stopped and hold nothing of the rogue's; alice is served (from her cache)."""
    for node in (pair.prefill, pair.decode):
        assert not node.loop.is_stopped, f"the rogue shut {node.config.role} down"
    assert pair.decode.steps.num_reservations() == 0, "the rogue holds a reservation"
    handoff = pair.generate(SECRET_PROMPT, GREEDY, tenant="alice")
    assert handoff.final.error is None and handoff.reserved is not None and handoff.reserved.num_cached_tokens == 112
    pair.assert_clean()


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("kind", ROGUES)
def test_an_engine_gives_a_rogue_nothing(pair: PdPair, role: str, kind: str) -> None:
    node = pair.decode if role == "decode" else pair.prefill
    rogue = rogue_of(pair, node, kind)
    try:
        msgs = frontend_msgs()
        rogue.send(*msgs)  # queued at once: they go out if and when the handshake succeeds
        handshake = rogue.handshake(lambda: pump_turns(pair, 1))
        if kind == "prefill's peer key" and role == "decode":
            # in: decode accepts prefill's key, as a peer, and refuses every frontend message from it
            assert handshake == "succeeded"
            pair.pump(lambda: node.guard.num_refused_messages == len(msgs), "the refusals")
        else:  # out: the handshake never completes, so not one byte reaches the engine
            # no key: the mechanisms differ (NULL against CURVE); a key of its own: ZAP refuses it
            assert handshake in (("failed_protocol", "failed") if kind == "no key" else ("refused_key",))
            # plain ZMQ: `not_curve`, or `incomplete` when the client saw the mismatch first and hung up
            reasons = {"not_curve", "incomplete"} if kind == "no key" else {"unlisted_key"}
            pair.pump(lambda: bool(node.guard.refused_handshakes), "the refused handshake to be counted")
            pump_turns(pair)
            assert set(node.guard.refused_handshakes) <= reasons  # plain ZMQ retries: maybe more than one
            assert kind == "no key" or node.guard.refused_handshakes["unlisted_key"] == 1
            assert node.guard.num_refused_messages == 0, "a message got past a failed handshake"
        assert rogue.collect(wait_ms=200) == [], "the engine answered a rogue"
    finally:
        rogue.close()
    assert_still_serves(pair)


def test_a_flood_of_plain_zmq_clients_is_counted_and_logged_at_a_bounded_rate(
        pair: PdPair, caplog: pytest.LogCaptureFixture) -> None:
    """Plain-ZMQ clients fail on the mechanism before ZAP is asked: the ROUTER's monitor counts
    every one (reason `not_curve`, or `incomplete` where the client hung up first; in the engine's
    stats for /metrics), and the log gets one line
    per interval however many came (the clock stands still here), then one saying how many went
    unlogged."""
    node = pair.decode
    clock = {"now_s": 0.0}
    node.guard.refusal_log.clock = lambda: clock["now_s"]
    flood = [Rogue(node.config.listen, None, None) for _ in range(NUM_FLOOD)]
    try:
        with caplog.at_level(logging.WARNING, logger="kvseal.disagg"):
            pair.pump(lambda: num_plain(node.guard.refused_handshakes) >= NUM_FLOOD, "every refusal counted")
            assert len(refusal_lines(caplog)) == 1
            clock["now_s"] += node.guard.refusal_log.interval_s
            pair.pump(lambda: len(refusal_lines(caplog)) == 2, "the next window's line")
        assert "not logged" in refusal_lines(caplog)[1]
    finally:
        for rogue in flood:
            rogue.close()
    assert num_plain(node.link.stats().refused_handshakes) >= NUM_FLOOD
    assert_still_serves(pair)


def num_plain(refused: Mapping[str, int]) -> int:
    return refused.get("not_curve", 0) + refused.get("incomplete", 0)


def refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("refused a handshake")]


def test_a_frontend_key_may_not_commit_or_send_kv(pair: PdPair) -> None:
    """The other direction of the role check: the frontend may reserve, but never commit a
    transfer (only an authenticated prefill engine does)."""
    handoff = pair.reserve(SECRET_PROMPT, GREEDY, tenant="alice")
    r = handoff.reserved
    assert r is not None
    pair.to_decode.send(CommitMsg(r.transfer_id, handoff.request_id, "alice", len(SECRET_PROMPT),
                                  [WrittenRangeMsg(layer, 0, len(SECRET_PROMPT)) for layer in range(2)], 5, None,
                                  torch.Generator().get_state().numpy().tobytes(), "frontend"))
    pair.pump(lambda: pair.decode.guard.num_refused_messages == 1, "the refusal")
    assert not handoff.outputs and pair.decode.link.stats().num_refused_messages == 1
    pair.to_decode.send(AbortMsg(handoff.request_id, "alice", "test over"))
    pair.pump(lambda: handoff.is_terminal, "the release")
    pair.assert_clean()


def oracle(pair: PdPair, rogue: Rogue, prompt: list[int], request_id: str) -> ReservedMsg:
    """The rogue's question to decode, and its answer (the reservation is released after)."""
    rogue.send(probe(prompt, request_id))
    pair.pump(lambda: any(isinstance(m, ReservedMsg) and m.request_id == request_id for m in rogue.collect()),
              "decode's answer")  # to this question: an earlier answer is in `received` too
    reserved = next(m for m in rogue.received if isinstance(m, ReservedMsg) and m.request_id == request_id)
    rogue.send(AbortMsg(request_id, "alice", "the rogue is done"))
    pair.pump(lambda: pair.decode.steps.num_reservations() == 0, "the release")
    return reserved


def test_with_authentication_off_a_strangers_reservation_reads_alices_cached_prefix(pair: PdPair) -> None:
    """Negative control for the allow-list: with `OPEN_ENGINE_LINKS` a key of the rogue's own
    finishes the handshake and counts as a frontend, and decode answers the oracle: 112 of
    alice's 113 tokens are cached, a wrong guess 0. Without the fault the same rogue gets
    nothing (`test_an_engine_gives_a_rogue_nothing`)."""
    with inject(Fault.OPEN_ENGINE_LINKS):
        rogue = rogue_of(pair, pair.decode, "its own key")
        try:
            assert rogue.handshake(lambda: pump_turns(pair, 1)) == "succeeded"
            rogue.send(HelloMsg("rogue"))
            pair.pump(lambda: any(isinstance(m, EngineInfoMsg) for m in rogue.collect()), "the hello answer")
            assert oracle(pair, rogue, SECRET_PROMPT, "guess-right").num_cached_tokens == 112
            assert oracle(pair, rogue, WRONG_GUESS, "guess-wrong").num_cached_tokens == 0
        finally:
            rogue.close()
    pair.assert_clean()


def test_with_the_role_check_off_a_peer_key_reads_the_cache_and_shuts_decode_down(pair: PdPair) -> None:
    """Negative control for the role check: with `SKIP_LINK_ROLE_CHECK` prefill's peer key says
    hello, reads stats, answers the oracle and stops decode."""
    with inject(Fault.SKIP_LINK_ROLE_CHECK):
        rogue = rogue_of(pair, pair.decode, "prefill's peer key")
        try:
            assert rogue.handshake(lambda: pump_turns(pair, 1)) == "succeeded"
            rogue.send(HelloMsg("rogue"))
            pair.pump(lambda: any(isinstance(m, PdStatsMsg) for m in rogue.collect()), "the stats")
            assert oracle(pair, rogue, SECRET_PROMPT, "guess-right").num_cached_tokens == 112
            rogue.send(ShutdownMsg("rogue"))
            pair.pump(lambda: pair.decode.loop.is_stopped, "decode stopping")
        finally:
            rogue.close()


def test_an_engine_router_is_a_curve_server_that_fails_closed_without_its_zap_handler(pair: PdPair) -> None:
    """The ROUTER takes CURVE only and enforces ZAP: with the engine's ZAP handler gone (stopped
    here), even the frontend's listed key is refused, rather than every key let in (libzmq's
    default without a handler). A handshake that ZAP never answers hangs until the client gives
    up (2 s here; a key let in succeeds at once)."""
    router = pair.decode.router
    assert router.getsockopt(zmq.CURVE_SERVER) == 1 and router.getsockopt(zmq.ZAP_ENFORCE_DOMAIN) == 1
    pair.decode.guard.close()
    frontend = Rogue(pair.decode.config.listen, pair.keys.frontend, pair.keys.decode.public, handshake_ivl_ms=2000)
    try:
        assert frontend.handshake(lambda: pump_turns(pair, 1)) != "succeeded"
    finally:
        frontend.close()
