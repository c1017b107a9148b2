"""The tcp-stream transport's own faults: a stream cut mid-payload, a short or oversize
payload, a payload for a transfer decode never authorized or already cancelled, a record not
sealed with the transfer's key (a stranger's, a replayed or an old-format one), and a commit
that overtakes its data. Each fails closed: nothing lands outside what fully arrived for an
authorized transfer under its key, and a commit is verified only against what did."""

from __future__ import annotations

import select
import socket
import struct
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from pd_harness import Handoff, PdPair
from test_handoff import GREEDY, args
from test_handoff_faults import PROMPT, assert_refused_by_decode, rogue_commit

from kvseal._testing.faults import Fault, inject
from kvseal.disagg.msgs import KVBlockMsg, KVStreamEndMsg, StreamHeaderMsg, encode_stream_header
from kvseal.disagg.stream import (
    MAGIC,
    MAX_CONNECTIONS,
    PREFIX,
    TAG_BYTES,
    StreamReceiver,
    StreamSender,
    sealed_record,
    split_address,
)
from kvseal.disagg.transport import CANCELLED, PushPlan, RecentlyEnded, TransportError
from kvseal.kvcache.pool import KVPool
from kvseal.messages.msgs import AbortMsg
from kvseal.models.loader import load_model

NUM_LAYERS, NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM = 2, 16, 4, 2, 8
PAGE_BYTES = PAGE_SIZE * HEAD_DIM * 4  # float32
MAX_TURNS = 2000
KEY = bytes(range(32))  # the transfers' key in these tests (decode draws a random one per reservation)


class Sealer:
    """Records as a sender holding `key` makes them: each transfer's numbered from 0, in order."""

    def __init__(self, key: bytes = KEY) -> None:
        self.key = key
        self.numbers: Counter[str] = Counter()

    def __call__(self, header: StreamHeaderMsg, payload_bytes: int) -> bytes:
        number = self.numbers[header.transfer_id]
        self.numbers[header.transfer_id] += 1
        return sealed_record(header, payload_bytes, self.key, number)


def plan(transfer_id: str, src: list[int], written: list[int], address: str, dest: list[int]) -> PushPlan:
    return PushPlan(transfer_id, src, written, address, dest, transfer_key=KEY, decode_key=b"")


def make_pool() -> KVPool:
    pool = KVPool(NUM_LAYERS, NUM_PAGES, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, torch.float32)
    for t in pool.k + pool.v:
        t.normal_()
    return pool


@pytest.fixture(params=["in-place", "staged"])
def receiver(request: pytest.FixtureRequest) -> Iterator[StreamReceiver]:
    """Decode's receiver: blocks land in the pool in place (a host pool), or are staged in a host
    buffer and copied in once complete (what a GPU pool does; `test_stream_staging.py`)."""
    r = StreamReceiver(make_pool(), NUM_LAYERS, "127.0.0.1")
    if request.param == "staged":
        r._on_host, r._pool_bytes = False, None
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
    receiver.authorize("t-1", [3, 4, 5, 6], key=KEY)
    sock = connect(receiver)
    sock.sendall(Sealer()(KVBlockMsg("t-1", 0, "k", 0, 16), block_bytes(4)) + bytes(block_bytes(4) // 2))
    take_in(receiver, lambda: receiver.settled("t-1") is False and receiver._connections[0].block is not None,
            "half the payload")
    assert not receiver.settled("t-1"), "the stream has not caught up: a commit must wait"
    reset(sock)
    take_in(receiver, lambda: receiver.settled("t-1"), "the reset")
    landing = receiver.landed("t-1")
    assert landing is not None and not landing.ranges and landing.num_bytes == 0, "a cut block never counts"
    assert receiver.take_refusals() == {"stream_broken": 1}


def test_a_short_payload_is_refused_and_the_stream_stays_in_step(receiver: StreamReceiver) -> None:
    receiver.authorize("t-1", [3, 4, 5, 6], key=KEY)
    before = snapshot(receiver)
    sock, seal = connect(receiver), Sealer()
    short = block_bytes(4) - 2
    sock.sendall(seal(KVBlockMsg("t-1", 0, "k", 0, 16), short) + b"\x7f" * short)
    sock.sendall(seal(KVStreamEndMsg("t-1", short), 0))  # parsed as a record: the framing held
    take_in(receiver, lambda: receiver.settled("t-1"), "the end record")
    assert unchanged(receiver, before), "a refused payload landed"
    landing = receiver.landed("t-1")
    assert landing is not None and not landing.ranges
    assert receiver.take_refusals() == {"bad_block_size": 1, "short_payload": 1}
    sock.close()


def test_a_cancelled_transfers_late_records_never_land_and_the_stream_stays_in_step(receiver: StreamReceiver) -> None:
    """The rest of a block on the wire when its transfer is cancelled, and the transfer's later
    records (still sealed with its key), are read and dropped, refused as `cancelled` (a client
    gone mid-handoff, not an unauthorized transfer); the next transfer on the same stream lands."""
    receiver.authorize("t-1", [3, 4, 5, 6], key=KEY)
    sock, seal = connect(receiver), Sealer()
    half = block_bytes(4) // 2
    sock.sendall(seal(KVBlockMsg("t-1", 0, "v", 0, 16), block_bytes(4)) + b"\x7f" * half)
    take_in(receiver, lambda: receiver._connections[0].block is not None
            and receiver._connections[0].block.offset + receiver._connections[0].block.index > 0, "half a block")
    assert receiver.cancel("t-1"), "the receiver is the only writer: cancel is final at once"
    before = snapshot(receiver)  # the pages go back to the pool now; nothing may change them
    sock.sendall(b"\x7f" * half)  # the rest of the cancelled block
    sock.sendall(seal(KVBlockMsg("t-1", 1, "k", 0, 16), block_bytes(4)) + b"\x7f" * block_bytes(4))
    sock.sendall(seal(KVStreamEndMsg("t-1", 2 * block_bytes(4)), 0))
    receiver.authorize("t-2", [8, 9], key=KEY)
    sock.sendall(seal(KVBlockMsg("t-2", 0, "k", 0, 8), block_bytes(2)) + b"\x11" * block_bytes(2))
    sock.sendall(seal(KVStreamEndMsg("t-2", block_bytes(2)), 0))
    take_in(receiver, lambda: receiver.settled("t-2"), "the next transfer")
    assert receiver.landed("t-1") is None and receiver.settled("t-1")
    landing = receiver.landed("t-2")
    assert landing is not None and landing.covered_prefix(0, "k") == 8, "the stream stayed in step"
    pool = receiver._pool
    assert (pool.k[0][:, [8, 9]].view(torch.uint8) == 0x11).all()
    after = snapshot(receiver)
    assert all(torch.equal(a, b) for i, (a, b) in enumerate(zip(before, after)) if i != 0), "t-1 landed after cancel"
    assert torch.equal(before[0][:, [3, 4, 5, 6]], after[0][:, [3, 4, 5, 6]])
    assert receiver.take_refusals() == {CANCELLED: 1}
    sock.close()


def test_a_transfer_ended_longer_ago_than_the_receiver_remembers_is_a_stranger_again(receiver: StreamReceiver) -> None:
    """The memory of ended transfers is bounded: past it, the oldest one's late record no longer
    verifies (`bad_tag`, the stream closed), exactly as a transfer that never existed."""
    receiver._retired = RecentlyEnded(max_len=1)
    receiver.authorize("t-1", [3, 4], key=KEY)
    receiver.authorize("t-2", [5, 6], key=KEY)
    assert receiver.cancel("t-1") and receiver.cancel("t-2")  # t-1 is forgotten
    before = snapshot(receiver)
    sock, seal = connect(receiver), Sealer()
    sock.sendall(seal(KVBlockMsg("t-2", 0, "k", 0, 8), block_bytes(2)) + b"\x7f" * block_bytes(2))
    sock.sendall(seal(KVBlockMsg("t-1", 0, "k", 0, 8), block_bytes(2)) + b"\x7f" * block_bytes(2))
    take_in(receiver, lambda: len(receiver.fds()) == 1, "the stream closed")
    assert receiver.take_refusals() == {CANCELLED: 1, "bad_tag": 1}
    assert unchanged(receiver, before), "a late block landed"
    sock.close()


def test_blocks_outside_the_reservation_are_refused_and_never_land(receiver: StreamReceiver) -> None:
    """Headers naming positions past the reservation, an unaligned start or no such layer:
    refused before a byte lands, the payload dropped, the stream still in step. (A kind other
    than K or V does not decode as a header at all: a foreign record, below.)"""
    receiver.authorize("t-1", [3, 4, 5, 6], key=KEY)  # positions [0, 16)
    before = snapshot(receiver)
    sock, seal = connect(receiver), Sealer()
    bad = [(KVBlockMsg("t-1", 0, "k", 0, 20), block_bytes(5)),  # past the reservation
           (KVBlockMsg("t-1", 0, "k", 2, 16), block_bytes(4)),  # not page-aligned
           (KVBlockMsg("t-1", NUM_LAYERS, "k", 0, 16), block_bytes(4))]  # no such layer
    for header, size in bad:
        sock.sendall(seal(header, size) + b"\x7f" * size)
    sock.sendall(seal(KVStreamEndMsg("t-1", 0), 0))  # parsed as a record: the framing held
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
    (PREFIX.pack(b"KVS1", 40, 0), "bad_record"),  # the unsealed format before I9
    (PREFIX.pack(MAGIC, 10**6, 0), "bad_record"),  # a header larger than any header
    (PREFIX.pack(MAGIC, 3, 0) + b"\xc1\xc1\xc1" + bytes(TAG_BYTES), "bad_record"),  # not msgpack
])
def test_an_oversize_or_foreign_record_closes_the_stream(receiver: StreamReceiver, prefix: bytes, why: str) -> None:
    receiver.authorize("t-1", [3, 4, 5, 6], key=KEY)
    before = snapshot(receiver)
    sock = connect(receiver)
    sock.sendall(prefix)
    assert_closed_by_decode(receiver, sock)
    assert unchanged(receiver, before)
    assert receiver.take_refusals() == {why: 1}
    sock.close()


def assert_closed_by_decode(receiver: StreamReceiver, sock: socket.socket) -> None:
    take_in(receiver, lambda: len(receiver.fds()) == 1, "the receiver closing the stream")
    sock.settimeout(5.0)
    try:
        assert sock.recv(1) == b"", "decode closed the connection"
    except ConnectionResetError:
        pass  # closed with unread bytes in its buffer: the peer sees a reset


def unsealed(header: KVBlockMsg, payload_bytes: int, tag: bytes) -> bytes:
    encoded = encode_stream_header(header)
    return PREFIX.pack(MAGIC, len(encoded), payload_bytes) + encoded + tag


STRANGER_RECORDS = {
    "a stranger's key": lambda: Sealer(bytes(32))(KVBlockMsg("t-1", 0, "k", 0, 16), block_bytes(4)),
    "no tag at all": lambda: unsealed(KVBlockMsg("t-1", 0, "k", 0, 16), block_bytes(4), bytes(TAG_BYTES)),
    "the right key at the wrong place": lambda: sealed_record(KVBlockMsg("t-1", 0, "k", 0, 16), block_bytes(4), KEY, 1),
    "a transfer decode never authorized": lambda: Sealer()(KVBlockMsg("t-9", 0, "k", 0, 16), block_bytes(4)),
}


@pytest.mark.parametrize("what", sorted(STRANGER_RECORDS))
def test_a_record_not_sealed_with_the_transfers_key_lands_nothing_and_closes_the_stream(
        receiver: StreamReceiver, what: str) -> None:
    """A stranger who knows a live transfer id (it is in clear in every header on this stream)
    but not its key: decode checks the tag before it acts on the header, so not one payload
    byte reaches a page, the transfer stays open for its real sender, and the stream is closed."""
    receiver.authorize("t-1", [3, 4, 5, 6], key=KEY)
    before = snapshot(receiver)
    sock = connect(receiver)
    sock.sendall(STRANGER_RECORDS[what]() + b"\x7f" * block_bytes(4))
    assert_closed_by_decode(receiver, sock)
    assert unchanged(receiver, before), "a byte of an unsealed record landed"
    landing = receiver.landed("t-1")
    assert landing is not None and not landing.ranges and not receiver.settled("t-1")
    assert receiver.take_refusals() == {"bad_tag": 1}
    sock.close()


def test_a_replayed_record_is_refused(receiver: StreamReceiver) -> None:
    """A record captured off the wire and sent again (on another connection) carries the right
    key but the wrong place: refused, nothing of it lands twice."""
    receiver.authorize("t-1", [3, 4, 5, 6], key=KEY)
    record = Sealer()(KVBlockMsg("t-1", 0, "k", 0, 16), block_bytes(4)) + b"\x22" * block_bytes(4)
    first = connect(receiver)
    first.sendall(record)
    take_in(receiver, lambda: receiver.landed("t-1").covered_prefix(0, "k") == 16, "the first copy")  # type: ignore[union-attr]
    before = snapshot(receiver)
    replay = connect(receiver)
    replay.sendall(record)
    take_in(receiver, lambda: receiver.take_refusals() == {"bad_tag": 1}, "the refusal")
    assert unchanged(receiver, before)
    assert receiver.landed("t-1").num_bytes == block_bytes(4)  # type: ignore[union-attr]
    first.close()
    replay.close()


def test_without_the_tag_check_a_strangers_record_lands(receiver: StreamReceiver) -> None:
    """Negative control: with the tag check switched off (test-only fault), the same stranger's
    record lands in the reservation's pages, so the check above is what stops it."""
    receiver.authorize("t-1", [3, 4, 5, 6], key=KEY)
    before = snapshot(receiver)
    sock = connect(receiver)
    with inject(Fault.SKIP_STREAM_TAG_CHECK):
        sock.sendall(STRANGER_RECORDS["a stranger's key"]() + b"\x7f" * block_bytes(4))
        take_in(receiver, lambda: receiver.landed("t-1").covered_prefix(0, "k") == 16, "the landing")  # type: ignore[union-attr]
    assert not unchanged(receiver, before)
    assert (receiver._pool.k[0][:, [3, 4, 5, 6]].view(torch.uint8) == 0x7f).all()
    sock.close()


def test_pages_land_exactly_in_scattered_reservation_pages(receiver: StreamReceiver) -> None:
    """A sender's push (pages read straight from its pool) lands in decode's pages by decode's
    own reservation, scattered or not; the partial last page's tail is zero on decode."""
    src_pool = make_pool()
    src, dest = [9, 2, 3, 4], [7, 1, 2, 12]
    receiver.authorize("t-1", dest, key=KEY)
    sender = StreamSender()
    try:
        num_bytes = sender.push(plan("t-1", src, [14, 14], receiver.address, dest), src_pool)
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
            receiver.authorize(transfer_id, [0, 1], key=KEY)
            sender.push(plan(transfer_id, [0, 1], [8, 8], receiver.address, [0, 1]), src_pool)
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
                sender.push(plan("t-stall", pages, [256 * 16] * 2, address, pages), pool)
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
    records, _ = StreamSender()._records(pair.plan(r, list(range(len(r.pages))), [30, 30]),
                                         pair.prefill.engine.kv.pool)
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
    sock.sendall(data[:len(data) - 300])  # the end record (~90 bytes) and part of the last block never come
    reset(sock)
    rogue_commit(pair, handoff, 30, [30, 30])
    pair.pump(lambda: handoff.is_terminal, "the refusal")
    assert_refused_by_decode(handoff, "layer 1 V: only positions [0, 0)")
    assert pair.decode.link.stats().handoff_failures["stream_broken"] == 1
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
    failures = pair.decode.link.stats().handoff_failures
    assert failures[CANCELLED] >= 1 and "unauthorized_transfer" not in failures, failures
    pair.assert_clean()



@pytest.mark.parametrize("tag_check", ["on", "off"])
def test_a_rogue_stream_without_the_transfer_key_lands_no_byte_in_decodes_pool(stream_pair: PdPair,
                                                                               tag_check: str) -> None:
    """A stranger that knows decode's KV port and a live transfer id (both in clear on the
    stream) pushes a whole well-formed transfer sealed with a key of its own: not one byte
    reaches decode's pool, the stream is closed, and the real handoff then completes. With the
    tag check off (negative control) the same push lands in the reservation's pages."""
    pair = stream_pair
    handoff = pair.reserve(PROMPT, GREEDY)
    r = handoff.reserved
    assert r is not None
    prefill_pool, pool = pair.prefill.engine.kv.pool, pair.decode.engine.kv.pool
    prefill_pool.fill(list(range(len(r.pages))), 7.0)  # what the rogue pushes
    before = [t.clone() for t in pool.k + pool.v]
    rogue = PushPlan(r.transfer_id, list(range(len(r.pages))), [30, 30], r.kv_address, r.pages,
                     transfer_key=bytes(32), decode_key=b"")
    records, _ = StreamSender()._records(rogue, prefill_pool)
    sock = raw_stream(pair, r.kv_address)
    sock.sendall(b"".join(bytes(b) for b in records))
    receiver = pair.decode.transport
    if tag_check == "off":
        with inject(Fault.SKIP_STREAM_TAG_CHECK):
            pair.pump(lambda: receiver.settled(r.transfer_id), "the rogue's push")  # type: ignore[union-attr]
        landed = positions_of(pool.k[0], list(r.pages))[:, :30]
        assert (landed == 7.0).all(), "without the tag check the rogue's KV is in decode's pages"
        pair.to_decode.send(AbortMsg(handoff.request_id, "alice", "test over"))
        pair.pump(lambda: handoff.is_terminal, "the release")
        sock.close()
        return
    pair.pump(lambda: pair.decode.link.stats().handoff_failures.get("bad_tag", 0) == 1, "the refusal")
    assert all(torch.equal(a, b) for a, b in zip(before, pool.k + pool.v)), "a rogue byte landed in decode's pool"
    assert not receiver.landed(r.transfer_id).ranges  # type: ignore[union-attr]
    sock.settimeout(5.0)
    try:
        assert sock.recv(1) == b"", "decode closed the stream"
    except ConnectionResetError:
        pass  # closed with the rogue's unread bytes in its buffer: a reset
    sock.close()
    pair.to_prefill.send(pair.prefill_msg(handoff, PROMPT, GREEDY))  # the real prefill, with the key
    pair.wait(handoff)
    assert handoff.final.error is None and handoff.final.finish_reason == "length", handoff.final
    pair.assert_clean()


def positions_of(source: torch.Tensor, pages: list[int]) -> torch.Tensor:
    """[num_kv_heads, num_pages, page_size, head_dim] pages -> [num_kv_heads, positions, head_dim]"""
    part = source[:, torch.tensor(pages)]
    return part.reshape(part.shape[0], -1, part.shape[-1])


def test_strangers_holding_every_connection_slot_do_not_lock_a_sender_out(receiver: StreamReceiver) -> None:
    """Connections that never send a verified record are the ones closed to make room: a
    stranger filling every slot cannot keep prefill's push out."""
    strangers = [connect(receiver) for _ in range(MAX_CONNECTIONS)]
    receiver.authorize("t-1", [0, 1], key=KEY)
    sender = StreamSender()
    try:
        sender.push(plan("t-1", [0, 1], [8, 8], receiver.address, [0, 1]), make_pool())
        take_in(receiver, lambda: receiver.settled("t-1"), "the push")
    finally:
        sender.close()
        for sock in strangers:
            sock.close()
    landing = receiver.landed("t-1")
    assert landing is not None and all(landing.covered_prefix(layer, kind) == 8 for layer in range(NUM_LAYERS)
                                       for kind in "kv")
    assert receiver.take_refusals() == {"unsealed_connection": 1}
