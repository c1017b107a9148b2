"""Strangers on decode's tcp-stream listener: connections that never send a verified record
(a local user with no key can open as many as it likes) must not cost a prefill its stream.

A prefill's new connection is a stranger too until decode reads its first sealed record. These
tests queue more than `MAX_CONNECTIONS` strangers behind it, around it, or between its connect
and its first byte, and check that its push still lands: decode reads each connection it
accepts before accepting the next, and closes strangers to make room only once they had a turn
to send something. Each scenario is set up by the order of connects and `progress` calls, not
by timing."""

from __future__ import annotations

import select
import socket

import pytest
import torch
from pd_harness import MAX_ITERATIONS, PdPair
from test_handoff import GREEDY
from test_handoff_faults import PROMPT
from test_stream_faults import (
    KEY,
    NUM_LAYERS,
    Sealer,
    block_bytes,
    connect,
    make_pool,
    plan,
    receiver,  # noqa: F401 (a fixture)
    stream_pair,  # noqa: F401 (a fixture)
    take_in,
)

from kvseal.disagg.msgs import KVBlockMsg, KVStreamEndMsg
from kvseal.disagg.stream import MAX_CONNECTIONS, StreamReceiver, StreamSender, split_address
from kvseal.disagg.transport import KINDS

MAX_QUEUED = 100  # strangers queued at once: under the listener's backlog (128), so no connect waits


def is_pending(listener: socket.socket) -> bool:
    """A connection is waiting in the listener's accept queue."""
    return bool(select.select([listener], [], [], 0)[0])


def queue_strangers(address: str, num: int) -> list[socket.socket]:
    """`num` connections that send nothing, left in the accept queue (decode has not run)."""
    return [socket.create_connection(split_address(address)) for _ in range(num)]


def accept_all(decode: StreamReceiver) -> None:
    """decode's loop until the accept queue is empty."""
    take_in(decode, lambda: not is_pending(decode._listener), "the accept queue to empty")


def fully_landed(decode: StreamReceiver, transfer_id: str, num_positions: int) -> bool:
    landing = decode.landed(transfer_id)
    return landing is not None and all(landing.covered_prefix(layer, kind) == num_positions
                                       for layer in range(NUM_LAYERS) for kind in KINDS)


@pytest.mark.parametrize(("num_before", "num_after"), [(0, MAX_QUEUED), (MAX_CONNECTIONS + 6, MAX_CONNECTIONS + 6)])
def test_strangers_around_a_new_sender_connection_do_not_push_it_out(receiver: StreamReceiver,  # noqa: F811
                                                                    num_before: int, num_after: int) -> None:
    """Prefill connects and pushes (the kernel holds its bytes), and more than
    `MAX_CONNECTIONS` strangers connect behind it before decode's loop runs, with or without
    strangers already holding every slot: the push lands and settles, and the connection stays
    up for the next push, whatever strangers keep coming."""
    strangers = queue_strangers(receiver.address, num_before)
    accept_all(receiver)
    receiver.authorize("t-1", [0, 1], key=KEY)
    sender, src_pool = StreamSender(), make_pool()
    try:
        sender.push(plan("t-1", [0, 1], [8, 8], receiver.address, [0, 1]), src_pool)
        assert is_pending(receiver._listener), "decode has not accepted prefill's connection yet"
        strangers += queue_strangers(receiver.address, num_after)
        accept_all(receiver)
        assert receiver.settled("t-1") and fully_landed(receiver, "t-1", 8), "prefill's push was dropped"
        stream = sender._sockets[receiver.address]
        for _ in range(3):  # 300 more strangers: the verified connection is never the one closed
            strangers += queue_strangers(receiver.address, MAX_QUEUED)
            accept_all(receiver)
        receiver.authorize("t-2", [2, 3], key=KEY)
        sender.push(plan("t-2", [0, 1], [8, 8], receiver.address, [2, 3]), src_pool)
        assert sender._sockets[receiver.address] is stream, "prefill had to reconnect"
        take_in(receiver, lambda: receiver.settled("t-2"), "the second push")
        assert fully_landed(receiver, "t-2", 8)
    finally:
        sender.close()
        for sock in strangers:
            sock.close()
    refusals = receiver.take_refusals()
    assert set(refusals) == {"unsealed_connection"}, refusals


def test_a_sender_whose_first_record_comes_after_decode_accepted_it_is_not_pushed_out(
        receiver: StreamReceiver) -> None:  # noqa: F811
    """Prefill's connection is accepted before its first byte arrives (it was descheduled
    between connect and send), then more than `MAX_CONNECTIONS` strangers queue and its records
    arrive before decode's loop runs again: decode reads every connection before it closes any
    to make room, so prefill's verifies and lands."""
    receiver.authorize("t-1", [3, 4], key=KEY)
    sock = connect(receiver)  # accepted, nothing sent yet
    strangers = queue_strangers(receiver.address, MAX_QUEUED)
    seal = Sealer()
    try:
        sock.sendall(seal(KVBlockMsg("t-1", 0, "k", 0, 8), block_bytes(2)) + b"\x11" * block_bytes(2))
        sock.sendall(seal(KVStreamEndMsg("t-1", block_bytes(2)), 0))
        accept_all(receiver)
        take_in(receiver, lambda: receiver.settled("t-1"), "the end record")
        landing = receiver.landed("t-1")
        assert landing is not None and landing.covered_prefix(0, "k") == 8, "prefill's stream was closed unread"
        assert (receiver._pool.k[0][:, [3, 4]].view(torch.uint8) == 0x11).all()
    finally:
        sock.close()
        for stranger in strangers:
            stranger.close()


# ---- the whole handoff, in one process ------------------------------------------------------


def test_a_handoff_completes_when_strangers_queue_behind_prefills_new_connection(
        stream_pair: PdPair) -> None:  # noqa: F811 (the fixture, imported above)
    """The reviewer's flood, made exact: prefill opens its first connection to decode and
    pushes; before decode's loop runs, more than `MAX_CONNECTIONS` empty connections queue
    behind it. The request completes (before, decode closed prefill's connection unread and the
    request waited for the reservation timeout)."""
    pair = stream_pair
    handoff = pair.reserve(PROMPT, GREEDY)
    r = handoff.reserved
    assert r is not None
    pair.to_prefill.send(pair.prefill_msg(handoff, PROMPT, GREEDY))
    for _ in range(MAX_ITERATIONS):  # prefill alone: it pushes and commits, decode has not run
        pair.prefill.loop.run_once(idle_poll_ms=1)
        pair._route()
        if handoff.prefill_result is not None:
            break
    assert handoff.prefill_result is not None and handoff.prefill_result.transfer_id == r.transfer_id
    strangers = queue_strangers(r.kv_address, MAX_QUEUED)
    try:
        pair.wait(handoff)
    finally:
        for sock in strangers:
            sock.close()
    assert handoff.final.error is None and handoff.final.finish_reason == "length", handoff.final
    failures = pair.decode.link.stats().handoff_failures
    assert set(failures) <= {"unsealed_connection"}, failures
    pair.assert_clean()
