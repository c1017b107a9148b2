"""The tcp-stream transport's own faults: a stream cut mid-payload, a short or oversize
payload, a payload for a transfer decode never authorized or already cancelled, and a commit
that overtakes its data. Each fails closed: nothing lands outside what fully arrived for an
authorized transfer, and a commit is verified only against what did."""

from __future__ import annotations

import select
import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from pd_harness import Handoff, PdPair
from test_handoff import GREEDY, args
from test_handoff_faults import PROMPT, assert_refused_by_decode, rogue_commit

from kvseal.disagg.msgs import KVBlockMsg, KVStreamEndMsg
from kvseal.disagg.stream import MAGIC, PREFIX, StreamReceiver, StreamSender, record_prefix, split_address
from kvseal.disagg.transport import PushPlan, TransportError
from kvseal.kvcache.pool import KVPool
from kvseal.messages.msgs import AbortMsg
from kvseal.models.loader import load_model

NUM_LAYERS, NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM = 2, 16, 4, 2, 8
PAGE_BYTES = PAGE_SIZE * HEAD_DIM * 4  # float32
MAX_TURNS = 2000


def make_pool() -> KVPool:
    pool = KVPool(NUM_LAYERS, NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    for t in pool.k + pool.v:
        t.normal_()
    return pool


@pytest.fixture
def receiver() -> Iterator[StreamReceiver]:
    r = StreamReceiver(make_pool(), NUM_LAYERS, "127.0.0.1")
    yield r
    r.close()


def connect(receiver: StreamReceiver) -> socket.socket:
    sock = socket.create_connection(split_address(receiver.address))
    take_in(receiver, lambda: len(receiver.fds()) > 1, "the connection")
    return sock


def take_in(receiver: StreamReceiver, until: Callable[[], bool], what: str) -> None:
    """decode's loop, bounded: wait on the receiver's sockets, then take in what is there."""
    for _ in range(MAX_TURNS):
        receiver.progress()
        if until():
            return
        select.select(receiver.fds(), [], [], 0.01)
    raise AssertionError(f"gave up waiting for {what}")


def block_bytes(num_pages: int) -> int:
    return NUM_KV_HEADS * num_pages * PAGE_BYTES


def snapshot(receiver: StreamReceiver) -> list[torch.Tensor]:
    pool = receiver._pool
    return [t.clone() for t in pool.k + pool.v]


def unchanged(receiver: StreamReceiver, before: list[torch.Tensor]) -> bool:
    pool = receiver._pool
    return all(torch.equal(a, b) for a, b in zip(before, pool.k + pool.v))


def reset(sock: socket.socket) -> None:
    """Close with a TCP reset (SO_LINGER 0), as a killed or crashed peer's stream ends."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_a_stream_reset_mid_payload_lands_nothing_and_settles_the_transfer(receiver: StreamReceiver) -> None:
    receiver.authorize("t-1", [3, 4, 5, 6])
    sock = connect(receiver)
    sock.sendall(record_prefix(KVBlockMsg("t-1", 0, "k", 0, 16), block_bytes(4)) + bytes(block_bytes(4) // 2))
    take_in(receiver, lambda: receiver.settled("t-1") is False and receiver._connections[0].block is not None,
            "half the payload")
    assert not receiver.settled("t-1"), "the stream has not caught up: a commit must wait"
    reset(sock)
    take_in(receiver, lambda: receiver.settled("t-1"), "the reset")
    landing = receiver.landed("t-1")
    assert landing is not None and not landing.ranges and landing.num_bytes == 0, "a cut block never counts"
    assert receiver.take_refusals() == {"stream_broken": 1}


def test_a_short_payload_is_refused_and_the_stream_stays_in_step(receiver: StreamReceiver) -> None:
    receiver.authorize("t-1", [3, 4, 5, 6])
    before = snapshot(receiver)
    sock = connect(receiver)
    short = block_bytes(4) - 2
    sock.sendall(record_prefix(KVBlockMsg("t-1", 0, "k", 0, 16), short) + b"\x7f" * short)
    sock.sendall(record_prefix(KVStreamEndMsg("t-1", short), 0))  # parsed as a record: the framing held
    take_in(receiver, lambda: receiver.settled("t-1"), "the end record")
    assert unchanged(receiver, before), "a refused payload landed"
    landing = receiver.landed("t-1")
    assert landing is not None and not landing.ranges
    assert receiver.take_refusals() == {"bad_block_size": 1, "short_payload": 1}
    sock.close()


def test_a_payload_for_an_unknown_or_cancelled_transfer_never_lands(receiver: StreamReceiver) -> None:
    receiver.authorize("t-1", [3, 4, 5, 6])
    sock = connect(receiver)
    sock.sendall(record_prefix(KVBlockMsg("not-a-transfer", 0, "k", 0, 16), block_bytes(4)) + b"\x7f" * block_bytes(4))
    half = block_bytes(4) // 2
    sock.sendall(record_prefix(KVBlockMsg("t-1", 0, "v", 0, 16), block_bytes(4)) + b"\x7f" * half)
    take_in(receiver, lambda: receiver._connections[0].block is not None
            and receiver._connections[0].block.offset + receiver._connections[0].block.index > 0, "half a block")
    assert receiver.cancel("t-1"), "the receiver is the only writer: cancel is final at once"
    before = snapshot(receiver)  # the pages go back to the pool now; nothing may change them
    sock.sendall(b"\x7f" * half)  # the rest of the cancelled block
    sock.sendall(record_prefix(KVBlockMsg("t-1", 1, "k", 0, 16), block_bytes(4)) + b"\x7f" * block_bytes(4))
    sock.sendall(record_prefix(KVStreamEndMsg("t-1", 3 * block_bytes(4)), 0))
    sock.close()  # the receiver reads every byte before it sees the end of the stream
    take_in(receiver, lambda: len(receiver.fds()) == 1, "the rest and the end of the stream")
    assert unchanged(receiver, before), "bytes of a cancelled transfer landed after the cancel"
    assert receiver.landed("t-1") is None and receiver.settled("t-1")
    assert receiver.take_refusals() == {"unauthorized_transfer": 2}


def test_blocks_outside_the_reservation_are_refused_and_never_land(receiver: StreamReceiver) -> None:
    """Headers naming positions past the reservation, an unaligned start or no such layer:
    refused before a byte lands, the payload dropped, the stream still in step. (A kind other
    than K or V does not decode as a header at all: a foreign record, below.)"""
    receiver.authorize("t-1", [3, 4, 5, 6])  # positions [0, 16)
    before = snapshot(receiver)
    sock = connect(receiver)
    bad = [(KVBlockMsg("t-1", 0, "k", 0, 20), block_bytes(5)),  # past the reservation
           (KVBlockMsg("t-1", 0, "k", 2, 16), block_bytes(4)),  # not page-aligned
           (KVBlockMsg("t-1", NUM_LAYERS, "k", 0, 16), block_bytes(4))]  # no such layer
    for header, size in bad:
        sock.sendall(record_prefix(header, size) + b"\x7f" * size)
    sock.sendall(record_prefix(KVStreamEndMsg("t-1", 0), 0))  # parsed as a record: the framing held
    take_in(receiver, lambda: receiver.settled("t-1"), "the end record")
    assert unchanged(receiver, before), "a refused block landed"
    landing = receiver.landed("t-1")
    assert landing is not None and not landing.ranges
    assert receiver.take_refusals() == {"write_outside_reservation": 2, "bad_block_address": 1}
    sock.close()


@pytest.mark.parametrize(("prefix", "why"), [
    (PREFIX.pack(MAGIC, 40, 2**40), "oversize"),  # a payload no block can have
    (PREFIX.pack(MAGIC, 40, block_bytes(NUM_PAGES) + 1), "oversize"),  # more than a whole layer of the pool
    (PREFIX.pack(b"HTTP", 40, 0), "bad_record"),  # not this protocol
    (PREFIX.pack(MAGIC, 10**6, 0), "bad_record"),  # a header larger than any header
    (PREFIX.pack(MAGIC, 3, 0) + b"\xc1\xc1\xc1", "bad_record"),  # not msgpack
])
def test_an_oversize_or_foreign_record_closes_the_stream(receiver: StreamReceiver, prefix: bytes, why: str) -> None:
    receiver.authorize("t-1", [3, 4, 5, 6])
    before = snapshot(receiver)
    sock = connect(receiver)
    sock.sendall(prefix)
    take_in(receiver, lambda: len(receiver.fds()) == 1, "the receiver closing the stream")
    sock.settimeout(5.0)
    assert sock.recv(1) == b"", "decode closed the connection"
    assert unchanged(receiver, before)
    assert receiver.take_refusals() == {why: 1}
    sock.close()


def test_pages_land_exactly_in_scattered_reservation_pages(receiver: StreamReceiver) -> None:
    """A sender's push (pages read straight from its pool) lands in decode's pages by decode's
    own reservation, scattered or not; the partial last page's tail is zero on decode."""
    src_pool = make_pool()
    src, dest = [9, 2, 3, 4], [7, 1, 2, 12]
    receiver.authorize("t-1", dest)
    sender = StreamSender()
    try:
        num_bytes = sender.push(PushPlan("t-1", src, [14, 14], receiver.address, dest), src_pool)
        take_in(receiver, lambda: receiver.settled("t-1"), "the push")
    finally:
        sender.close()
    landing = receiver.landed("t-1")
    assert landing is not None and landing.num_bytes == num_bytes == NUM_LAYERS * 2 * block_bytes(4)
    pool = receiver._pool
    for layer in range(NUM_LAYERS):
        for kind, got_t, want_t in (("k", pool.k[layer], src_pool.k[layer]), ("v", pool.v[layer], src_pool.v[layer])):
            assert landing.covered_prefix(layer, kind) == 14
            got = got_t[:, dest].reshape(NUM_KV_HEADS, -1, HEAD_DIM)
            want = want_t[:, src].reshape(NUM_KV_HEADS, -1, HEAD_DIM)
            assert torch.equal(got[:, :14], want[:, :14])
            assert torch.count_nonzero(got[:, 14:]) == 0


def test_a_sender_reconnects_after_decode_closed_its_stream(receiver: StreamReceiver) -> None:
    src_pool = make_pool()
    sender = StreamSender()
    try:
        for transfer_id in ("t-1", "t-2"):
            receiver.authorize(transfer_id, [0, 1])
            sender.push(PushPlan(transfer_id, [0, 1], [8, 8], receiver.address, [0, 1]), src_pool)
            take_in(receiver, lambda t=transfer_id: receiver.settled(t), "the push")  # type: ignore[misc]
            assert receiver.cancel(transfer_id)
            for conn in list(receiver._connections):  # as a restarted decode drops every stream
                receiver._close(conn, "test")
    finally:
        sender.close()
    assert receiver.take_refusals() == {}


def test_a_push_to_a_receiver_that_stops_reading_fails_after_the_send_timeout() -> None:
    """A decode that accepts the stream and then never reads (hung, stopped): once the kernel's
    buffers are full, the push fails with a TransportError after the sender's timeout instead of
    blocking prefill forever, and the connection is dropped."""
    pool = KVPool(2, 256, 16, 4, 64, torch.float32)  # a push of 32 MiB: more than loopback buffers hold
    pages = list(range(256))
    with socket.create_server(("127.0.0.1", 0)) as listener:
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        sender = StreamSender(timeout_s=0.5)
        try:
            with pytest.raises(TransportError, match="failed"):
                sender.push(PushPlan("t-stall", pages, [256 * 16] * 2, address, pages), pool)
            assert not sender._sockets, "the stalled connection is dropped"
        finally:
            sender.close()


# ---- the whole handoff, in one process ------------------------------------------------------


@pytest.fixture
def stream_pair(llama_dir: Path) -> Iterator[PdPair]:
    loaded = load_model(str(llama_dir), args(llama_dir).torch_dtype)
    pair = PdPair(args(llama_dir), args(llama_dir), loaded=loaded, kv_transport="tcp-stream")
    yield pair
    pair.close()


def raw_stream(pair: PdPair, kv_address: str) -> socket.socket:
    return socket.create_connection(split_address(kv_address))


def reserve_and_connect(pair: PdPair) -> tuple[Handoff, bytes, socket.socket]:
    """A reservation for PROMPT, the stream bytes prefill would send for it (every position, both
    layers), and a raw connection to decode's stream on which a test sends them as it likes."""
    handoff = pair.reserve(PROMPT, GREEDY)
    r = handoff.reserved
    assert r is not None
    plan = PushPlan(r.transfer_id, list(range(len(r.pages))), [30, 30], r.kv_address, r.pages)
    records, _ = StreamSender()._records(plan, pair.prefill.engine.kv.pool)
    return handoff, b"".join(bytes(b) for b in records), raw_stream(pair, r.kv_address)


def test_a_commit_waits_for_its_data_then_verifies(stream_pair: PdPair) -> None:
    """The commit travels on ZMQ and can overtake the data: decode holds it until the stream
    caught up, then verifies and runs it."""
    pair = stream_pair
    handoff, data, sock = reserve_and_connect(pair)
    sock.sendall(data[:len(data) // 2])
    rogue_commit(pair, handoff, 30, [30, 30])
    pair.pump(lambda: pair.decode.steps._parked != {}, "the commit held")  # type: ignore[attr-defined]
    for _ in range(20):
        pair.pump(lambda: True, "a turn")
    assert not handoff.outputs, "decode verified a commit before its data arrived"
    sock.sendall(data[len(data) // 2:])
    pair.pump(lambda: handoff.is_terminal, "the request")
    assert handoff.final.error is None and handoff.final.finish_reason == "length", handoff.final
    sock.close()
    pair.assert_clean()


def test_a_stream_reset_mid_transfer_refuses_the_commit_and_releases(stream_pair: PdPair) -> None:
    pair = stream_pair
    handoff, data, sock = reserve_and_connect(pair)
    sock.sendall(data[:len(data) - 100])  # the end record and part of the last block never come
    reset(sock)
    rogue_commit(pair, handoff, 30, [30, 30])
    pair.pump(lambda: handoff.is_terminal, "the refusal")
    assert_refused_by_decode(handoff, "layer 1 V: only positions [0, 0)")
    assert pair.decode.loop.stats().handoff_failures["stream_broken"] == 1
    pair.assert_clean()


def test_an_abort_during_a_stream_transfer_releases_and_drops_the_rest(stream_pair: PdPair) -> None:
    pair = stream_pair
    handoff, data, sock = reserve_and_connect(pair)
    sock.sendall(data[:len(data) // 3])
    pair.to_decode.send(AbortMsg(handoff.request_id, "alice", "client_disconnected"))
    pair.pump(lambda: handoff.is_terminal, "the release")
    assert handoff.final.finish_reason == "abort"
    pool = pair.decode.engine.kv.pool
    before = [t.clone() for t in pool.k + pool.v]
    sock.sendall(data[len(data) // 3:])
    sock.close()  # decode reads every byte before it sees the end of the stream
    receiver = pair.decode.transport
    pair.pump(lambda: len(receiver.fds()) == 1, "the rest of the stream")  # type: ignore[union-attr]
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k + pool.v)), "KV landed after the release"
    assert pair.decode.loop.stats().handoff_failures["unauthorized_transfer"] >= 1
    pair.assert_clean()

