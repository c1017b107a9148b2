"""The tcp-stream transport: KV on a plain TCP stream of its own, the commit on ZMQ as ever.

Decode's receiver listens on an ephemeral port of the host it was given (its KV address, sent
in `ReservedMsg`); prefill keeps one connection per decode. A push is one ordered run of
records on that stream, each `PREFIX` (magic, header length, payload length), a msgpack
header, the record's tag, then the payload:

- one `KVBlockMsg` per layer and K/V whose payload is, in order, each KV head's pages holding
  positions [start, end): full pages sent straight out of prefill's pool by `socket.sendmsg`
  (scatter-gather, no copy in user space), the last page, when partial, from a small staging
  copy with zeros past `end` (no stale bytes leave the pool);
- then one `KVStreamEndMsg` naming the payload bytes of the push.

`push` returns once the kernel holds every byte (the pool may be reused right after).

A pool on a GPU is staged through pinned host memory, on both sides: the sender copies each
block's pages (all heads, the partial last page zeroed past `end`) into a pinned buffer and sends
that; the receiver reads a block into a pinned buffer and copies it into the reservation's pages
once every byte arrived (only then is it recorded as landed). The wire format is the same.

Records are sealed (I9): the tag is HMAC-SHA256, truncated to 16 bytes, under the transfer's
secret key (`ReservedMsg.transfer_key`, which reaches prefill only over authenticated links and
never travels on this stream) over the record's number in its transfer, its prefix and its
header. Decode verifies it (`hmac.compare_digest`) before it acts on the header, so before a
payload byte lands; a record whose tag does not verify under a live (or recently ended)
transfer's key closes the connection, its payload unread. The number binds each record to its
place: a replayed or reordered record fails too. The payload itself is neither encrypted nor
authenticated (an on-path attacker who can rewrite the stream's bytes could change KV; the
`tcp` transport, whose frames ride the CURVE link, is the encrypted choice).

The listener is unauthenticated: a connection is prefill's only once a record on it verified,
a stranger until then. Decode reads each connection as it accepts it, before the next (a prefill
sends its first record as soon as it connects), and closes strangers to make room only after
reading every connection and never in the `progress` that accepted them (`_make_room`): a flood
of empty connections cannot push out a prefill's new one, nor close a verified one.

Decode's receiver runs on decode's engine thread (`progress`, every loop iteration). It reads
each header, checks it against the reservation decode authorized (the sender names positions,
never decode's pages), and only then receives the payload with `recv_into` straight into that
reservation's pages (no copy out of library buffers). A block is recorded as landed only once
every byte of it arrived; a header it refuses has its payload read into a scratch buffer and
dropped; a payload length no block can have closes the connection. `cancel` is final at once:
it is the only writer, and a block of a cancelled transfer still on the wire goes to the
scratch buffer from then on; its later records (verified under the retired seal) are refused
as `cancelled`, the benign reason, never as an unauthorized transfer. The commit travels on
ZMQ, so it can overtake the data: decode verifies a commit only once the transfer is `settled`
here, i.e. its `KVStreamEndMsg` was read (every block before it was too) or the stream
carrying it broke.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import select
import socket
import struct
from collections import Counter
from dataclasses import dataclass, field

import msgspec
import torch

from kvseal._testing.faults import Fault, is_active
from kvseal.disagg.msgs import KVBlockMsg, KVStreamEndMsg, StreamHeaderMsg, decode_stream_header, encode_stream_header
from kvseal.disagg.tcp import PoolBytes, flat_bytes
from kvseal.disagg.transport import (
    CANCELLED,
    KINDS,
    Landing,
    OneAddress,
    PushPlan,
    RecentlyEnded,
    TransportError,
    check_pool_pages,
    log_refused_block,
    page_runs,
)
from kvseal.kvcache.pool import KVPool

logger = logging.getLogger("kvseal.disagg")

NAME = "tcp-stream"
PREFIX = struct.Struct("!4sIQ")  # magic, header bytes, payload bytes
MAGIC = b"KVS2"  # v2: every record carries a tag after its header
TAG_BYTES = 16  # HMAC-SHA256, truncated
TAG_DOMAIN = b"kvseal/kv-stream-record/v2\0"
RECORD_NUMBER = struct.Struct("!Q")
MAX_HEADER_BYTES = 4096
CONNECT_TIMEOUT_S = 3.0
SEND_TIMEOUT_S = 30.0  # one sendmsg that moves nothing for this long: the link is stalled
IOV_PER_CALL = 512  # buffers per sendmsg (IOV_MAX is 1024 on Linux)
MAX_CONNECTIONS = 64  # prefill engines that may hold a data connection at once
# connections accepted per `progress`: a flood is taken in a batch at a time, and with the
# strangers of this batch spared until the next one, at most twice MAX_CONNECTIONS are open
MAX_ACCEPTS_PER_PROGRESS = MAX_CONNECTIONS
READ_BUDGET_BYTES = 256 * 1024 * 1024  # per connection and `progress`: the engine loop moves on
SCRATCH_BYTES = 1024 * 1024


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not (port.isascii() and port.isdigit()):
        raise TransportError(f"not a HOST:PORT KV address: {address!r}")
    return host, int(port)


# ---- prefill's side ------------------------------------------------------------------------


class StreamSender:
    name = NAME

    def __init__(self, timeout_s: float = SEND_TIMEOUT_S) -> None:
        self._timeout_s = timeout_s
        self._sockets: dict[str, socket.socket] = {}
        self._pool_bytes: PoolBytes | None = None

    def push(self, plan: PushPlan, pool: KVPool) -> int:
        buffers, num_bytes = self._records(plan, pool)
        sock = self._connect(plan.kv_address)
        try:
            send_buffers(sock, buffers)
        except OSError as exc:  # reset, refused, timed out: the receiver sees the stream break
            self._drop(plan.kv_address)
            raise TransportError(f"the KV stream to {plan.kv_address} failed: {exc}") from exc
        return num_bytes

    def _records(self, plan: PushPlan, pool: KVPool) -> tuple[list[bytes | memoryview], int]:
        """The push as buffers for `sendmsg`: per layer and K/V a block record, then the end."""
        if pool.device.type != "cpu":
            return staged_records(plan, pool)
        if self._pool_bytes is None or self._pool_bytes.pool is not pool:
            self._pool_bytes = PoolBytes(pool)  # the pool's tensors never move
        in_place, page_size = self._pool_bytes, pool.page_size
        buffers: list[bytes | memoryview] = []
        num_bytes = 0
        numbers = itertools.count()  # each record's number in the transfer, from 0
        for layer, first, pages, num_full in plan.sent_layers(page_size):
            end = plan.written[layer]
            runs = in_place.runs(pages[:num_full])
            for kind, source, whole in zip(KINDS, (pool.k[layer], pool.v[layer]), in_place.layer(layer)):
                tail = _tail(source, pages[-1], end % page_size) if num_full < len(pages) else None
                frames = in_place.frames(whole, runs, tail)  # the staged tail stays alive in its view
                size = sum(frame.nbytes for frame in frames)
                header = KVBlockMsg(plan.transfer_id, layer, kind, first * page_size, end)
                buffers.append(sealed_record(header, size, plan.transfer_key, next(numbers)))
                buffers += frames
                num_bytes += size
        buffers.append(sealed_record(KVStreamEndMsg(plan.transfer_id, num_bytes), 0, plan.transfer_key, next(numbers)))
        return buffers, num_bytes

    def _connect(self, address: str) -> socket.socket:
        """The live connection to `address`; a new one when the last one was closed by decode.
        Connections decode closed (a restarted decode listens elsewhere) are dropped here too:
        decode never writes on them, so readable means EOF or reset."""
        if self._sockets:
            closed = set(select.select(list(self._sockets.values()), [], [], 0)[0])
            for old in [a for a, s in self._sockets.items() if s in closed]:
                self._drop(old)
        sock = self._sockets.get(address)
        if sock is None:
            try:
                sock = socket.create_connection(split_address(address), timeout=CONNECT_TIMEOUT_S)
            except OSError as exc:
                raise TransportError(f"cannot reach the KV receiver at {address}: {exc}") from exc
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self._timeout_s)
            self._sockets[address] = sock
        return sock

    def _drop(self, address: str) -> None:
        sock = self._sockets.pop(address, None)
        if sock is not None:
            sock.close()

    def close(self) -> None:
        for address in list(self._sockets):
            self._drop(address)


def host_buffer(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A host buffer for staging a GPU pool's pages: pinned (page-locked, so the device copies
    it by DMA), from torch's caching host allocator, which reuses freed buffers. Plain memory
    where no GPU is present (the staged path's tests on CPU)."""
    return torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())


def staged_records(plan: PushPlan, pool: KVPool) -> tuple[list[bytes | memoryview], int]:
    """`StreamSender._records` for a pool on a GPU: each block's pages of every head copied into
    a pinned host buffer (the partial last page zeroed past `end`), sent from there. The same
    records and payload bytes as from a host pool."""
    buffers: list[bytes | memoryview] = []
    num_bytes, page_size = 0, pool.page_size
    numbers = itertools.count()
    for layer, first, pages, num_full in plan.sent_layers(page_size):
        end = plan.written[layer]
        blocks = pool.export_pages(layer, torch.tensor(pages, dtype=torch.int64))  # K, V [kv_heads, n, page_size, D]
        for kind, block in zip(KINDS, blocks):
            staged = host_buffer(block.shape, block.dtype)
            staged.copy_(block)
            if num_full < len(pages):
                staged[:, -1, end % page_size:] = 0
            frame = flat_bytes(staged)  # holds `staged` alive until the kernel took the bytes
            header = KVBlockMsg(plan.transfer_id, layer, kind, first * page_size, end)
            buffers += [sealed_record(header, frame.nbytes, plan.transfer_key, next(numbers)), frame]
            num_bytes += frame.nbytes
    buffers.append(sealed_record(KVStreamEndMsg(plan.transfer_id, num_bytes), 0, plan.transfer_key, next(numbers)))
    return buffers, num_bytes


def _tail(source: torch.Tensor, page: int, num_positions: int) -> torch.Tensor:
    """A copy of one page of every head, zeroed from `num_positions` on. -> [kv_heads, page_size, head_dim]"""
    staged = source[:, page].clone()
    staged[:, num_positions:] = 0
    return staged


def record_tag(key: bytes, number: int, head: bytes | bytearray) -> bytes:
    """The tag of the record numbered `number` in its transfer whose prefix and header are `head`."""
    return hmac.digest(key, TAG_DOMAIN + RECORD_NUMBER.pack(number) + head, "sha256")[:TAG_BYTES]


def sealed_record(header: StreamHeaderMsg, payload_bytes: int, key: bytes, number: int) -> bytes:
    """A record's prefix, header and tag (its payload follows): the `number`th of its transfer."""
    encoded = encode_stream_header(header)
    head = PREFIX.pack(MAGIC, len(encoded), payload_bytes) + encoded
    return head + record_tag(key, number, head)


def send_buffers(sock: socket.socket, buffers: list[bytes | memoryview]) -> None:
    """Every byte of `buffers`, in order, by scatter-gather `sendmsg` (no copy in user space)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    index = 0
    while index < len(views):
        sent = sock.sendmsg(views[index:index + IOV_PER_CALL])
        while sent:
            size = views[index].nbytes
            if sent < size:
                views[index] = views[index][sent:]
                break
            sent -= size
            index += 1


# ---- decode's side -------------------------------------------------------------------------


@dataclass
class _Seal:
    """A transfer's secret key (every record of it is sealed under it), and how many of its
    records verified so far: the number the next one must carry."""

    key: bytes = field(repr=False)
    num_records: int = 0


@dataclass
class _Transfer:
    pages: list[int]
    runs: list[tuple[int, int, int]]  # page_runs(pages)
    start: int  # the first position it may write
    landing: Landing
    seal: _Seal


@dataclass
class _Block:
    """A block whose header was accepted: its payload goes into `views`, in order."""

    header: KVBlockMsg
    views: list[memoryview]
    num_bytes: int
    index: int = 0
    offset: int = 0
    # a pool on a GPU: the pinned host buffer `views` point into ([kv_heads, num_pages, page_size,
    # head_dim]), copied into the reservation's pages once the block is complete
    staged: torch.Tensor | None = None


@dataclass
class _Connection:
    sock: socket.socket
    prefix: bytearray = field(default_factory=lambda: bytearray(PREFIX.size))
    num_read: int = 0  # of the prefix, then of the header
    header: bytearray | None = None
    payload_bytes: int = 0
    block: _Block | None = None
    discard: int = 0  # payload bytes still to drop
    transfer_id: str | None = None  # the last transfer a header named on this stream
    is_sealed: bool = False  # a record of it verified: its peer holds a transfer key
    is_new: bool = True  # accepted in the `progress` running now: never closed to make room in it


class _StreamBroken(Exception):
    """The peer closed the connection (`refused` False), or broke the framing and decode
    closes it (`refused` True: the refusal is counted already)."""

    def __init__(self, message: str, refused: bool = False) -> None:
        super().__init__(message)
        self.refused = refused


class StreamReceiver(OneAddress):
    name = NAME

    def __init__(self, pool: KVPool, num_layers: int, host: str) -> None:
        self._pool = pool
        self._num_layers = num_layers
        self._on_host = pool.device.type == "cpu"  # else each block is staged in pinned host memory
        self._pool_bytes = PoolBytes(pool) if self._on_host else None
        num_kv_heads, page_size, head_dim = pool.page_shape()
        self._page_bytes = page_size * head_dim * pool.k[0].element_size()
        self._head_bytes = pool.num_pages * self._page_bytes
        self._max_block_bytes = num_kv_heads * self._head_bytes  # one whole layer's K or V
        self._listener = socket.create_server((host, 0))  # the host given; an ephemeral port
        self._listener.setblocking(False)
        self._address = f"{host}:{self._listener.getsockname()[1]}"
        self._transfers: dict[str, _Transfer] = {}
        # ended transfers' seals: their late records are verified, then dropped (as `CANCELLED`)
        self._retired: RecentlyEnded[_Seal] = RecentlyEnded()
        self._settled: set[str] = set()  # authorized transfers whose stream ended or broke
        self._connections: list[_Connection] = []
        self._scratch = bytearray(SCRATCH_BYTES)
        self.refusals: Counter[str] = Counter()  # why records were refused (taken by `take_refusals`)

    def authorize(self, transfer_id: str, pages: list[int], start: int = 0, *, key: bytes) -> None:
        check_pool_pages(self._pool, pages)
        self._transfers[transfer_id] = _Transfer(list(pages), page_runs(pages), start,
                                                 Landing(start + len(pages) * self._pool.page_size), _Seal(key))

    def landed(self, transfer_id: str) -> Landing | None:
        transfer = self._transfers.get(transfer_id)
        return None if transfer is None else transfer.landing

    def settled(self, transfer_id: str) -> bool:
        """True once nothing more of `transfer_id` is coming on any stream that carried it: its
        end record was read, or its stream broke (or it is not authorized here at all)."""
        self.progress()
        return transfer_id not in self._transfers or transfer_id in self._settled

    def sender_done(self, transfer_id: str) -> None:
        pass  # `settled` says when the stream caught up with the commit

    def deliver(self, header: KVBlockMsg, payload: list[memoryview]) -> str | None:
        return "wrong_transport"  # KV reaches a tcp-stream decode engine only on its data socket

    def take_refusals(self) -> Counter[str]:
        refusals, self.refusals = self.refusals, Counter()
        return refusals

    def cancel(self, transfer_id: str) -> bool:
        transfer = self._transfers.pop(transfer_id, None)
        if transfer is not None:
            self._retire(transfer_id, transfer.seal)
        self._settled.discard(transfer_id)
        for conn in self._connections:  # the rest of a block on the wire is dropped, not landed
            block = conn.block
            if block is not None and block.header.transfer_id == transfer_id:
                conn.discard = block.num_bytes - sum(v.nbytes for v in block.views[:block.index]) - block.offset
                conn.block = None
        return True  # this receiver is the only writer: nothing of the transfer can land now

    def _retire(self, transfer_id: str, seal: _Seal) -> None:
        """Keep an ended transfer's seal a while: a record of it still on the wire is verified
        and dropped (the stream stays in step); one older than that closes the stream."""
        self._retired.add(transfer_id, seal)

    def fds(self) -> list[socket.socket]:
        """What to wait on for data (the listener and every connection)."""
        return [self._listener, *(conn.sock for conn in self._connections)]

    def progress(self) -> None:
        """Accept new connections, then read what is there, without blocking; then make room."""
        self._accept()
        for conn in list(self._connections):
            self._take_in(conn)
        self._make_room()

    def close(self) -> None:
        for conn in list(self._connections):
            self._close(conn, "closing", refused=True)
        self._listener.close()

    def _take_in(self, conn: _Connection) -> None:
        try:
            self._read(conn)
        except _StreamBroken as exc:
            self._close(conn, str(exc), exc.refused)
        except OSError as exc:  # reset by the peer
            self._close(conn, str(exc) or type(exc).__name__)

    def _accept(self) -> None:
        """Accept up to `MAX_ACCEPTS_PER_PROGRESS` waiting connections, each read at once: a
        prefill's first record (sent as soon as it connects, so usually there before decode
        accepts) verifies before the next connection is even accepted, and connections queued
        behind it cannot push it out."""
        for _ in range(MAX_ACCEPTS_PER_PROGRESS):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            conn = _Connection(sock)
            self._connections.append(conn)
            self._take_in(conn)

    def _make_room(self) -> None:
        """Keep at most `MAX_CONNECTIONS` open: close strangers (no verified record), oldest
        first, but never one accepted in this `progress` (it may not have had the time to send its
        first record; it is a candidate from the next one on). A verified connection is never
        closed for a stranger: only verified ones past `MAX_CONNECTIONS`, the newest, are refused."""
        excess = len(self._connections) - MAX_CONNECTIONS
        strangers = [conn for conn in self._connections if not conn.is_sealed and not conn.is_new]
        for stranger in strangers[:max(excess, 0)]:
            self.refusals["unsealed_connection"] += 1
            self._close(stranger, "evicted: no verified record", refused=True)
        sealed = [conn for conn in self._connections if conn.is_sealed]
        for conn in sealed[MAX_CONNECTIONS:]:
            self.refusals["too_many_connections"] += 1
            logger.warning("closed a KV stream connection: %d verified ones open already", MAX_CONNECTIONS)
            self._close(conn, "too many verified connections", refused=True)
        for conn in self._connections:
            conn.is_new = False

    def _close(self, conn: _Connection, why: str, refused: bool = False) -> None:
        """The stream ended: a block cut short never counts, and its transfer is settled (a
        commit that follows is verified against what fully landed, and refused if short).
        `refused`: decode closes it (a refusal counted already, or shutting down)."""
        if not refused and (conn.block is not None or conn.discard or conn.header is not None or conn.num_read):
            self.refusals["stream_broken"] += 1
            logger.warning("a KV stream broke mid-record (%s)", why)
        if conn.transfer_id is not None and conn.transfer_id in self._transfers:
            self._settled.add(conn.transfer_id)
        conn.sock.close()
        self._connections.remove(conn)

    def _read(self, conn: _Connection) -> None:
        budget = READ_BUDGET_BYTES
        while budget > 0:
            try:
                if conn.block is not None:
                    num = self._read_block(conn, conn.block)
                elif conn.discard:
                    num = conn.sock.recv_into(self._scratch, min(conn.discard, len(self._scratch)))
                    self._eof_if_zero(num)
                    conn.discard -= num
                else:
                    num = self._read_header(conn)
            except (BlockingIOError, InterruptedError):
                return
            budget -= num

    @staticmethod
    def _eof_if_zero(num: int) -> None:
        if num == 0:
            raise _StreamBroken("the peer closed the stream")

    def _read_block(self, conn: _Connection, block: _Block) -> int:
        """One scatter `recvmsg_into` straight into the block's next views (many per call:
        scattered reservation pages are one view per page and head)."""
        views = block.views[block.index:block.index + IOV_PER_CALL]
        views[0] = views[0][block.offset:]
        num = conn.sock.recvmsg_into(views)[0]
        self._eof_if_zero(num)
        left = num
        while left:
            size = block.views[block.index].nbytes - block.offset
            if left < size:
                block.offset += left
                break
            left -= size
            block.index, block.offset = block.index + 1, 0
        if block.index == len(block.views):
            conn.block = None
            self._landed(block.header, block.num_bytes, block.staged)
        return num

    def _read_header(self, conn: _Connection) -> int:
        if conn.header is None:
            num = conn.sock.recv_into(memoryview(conn.prefix)[conn.num_read:])
            self._eof_if_zero(num)
            conn.num_read += num
            if conn.num_read == PREFIX.size:
                magic, header_bytes, conn.payload_bytes = PREFIX.unpack(conn.prefix)
                if magic != MAGIC or not 0 < header_bytes <= MAX_HEADER_BYTES:
                    self.refusals["bad_record"] += 1
                    raise _StreamBroken("not a KV stream record", refused=True)
                if conn.payload_bytes > self._max_block_bytes:
                    self.refusals["oversize"] += 1
                    raise _StreamBroken(f"a payload of {conn.payload_bytes} bytes: no block is that large",
                                        refused=True)
                conn.header, conn.num_read = bytearray(header_bytes + TAG_BYTES), 0
            return num
        num = conn.sock.recv_into(memoryview(conn.header)[conn.num_read:])
        self._eof_if_zero(num)
        conn.num_read += num
        if conn.num_read == len(conn.header):
            header, conn.header, conn.num_read = conn.header, None, 0
            self._on_header(conn, header)
        return num

    def _on_header(self, conn: _Connection, raw: bytearray) -> None:
        """A record's header and tag: nothing of it is acted on before the tag verified."""
        encoded, tag = raw[:-TAG_BYTES], raw[-TAG_BYTES:]
        try:
            header = decode_stream_header(encoded)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.refusals["bad_record"] += 1
            raise _StreamBroken(f"an undecodable KV stream header: {exc}", refused=True) from exc
        self._verify_tag(header.transfer_id, conn.prefix + encoded, tag)
        conn.transfer_id, conn.is_sealed = header.transfer_id, True
        if isinstance(header, KVStreamEndMsg):
            if conn.payload_bytes:
                self.refusals["bad_record"] += 1
                raise _StreamBroken("an end record with a payload", refused=True)
            self._on_end(header)
            return
        why = self._check(header, conn.payload_bytes)
        if why is not None:
            self.refusals[why] += 1
            log_refused_block(header.transfer_id, why)
            conn.discard = conn.payload_bytes
            return
        if self._on_host:
            conn.block = _Block(header, self._views(header), conn.payload_bytes)
            return
        staged = self._staging_buffer(header)
        conn.block = _Block(header, [flat_bytes(staged)], conn.payload_bytes, staged=staged)

    def _staging_buffer(self, header: KVBlockMsg) -> torch.Tensor:
        """A pinned host buffer for one block of a GPU pool: [kv_heads, num_pages, page_size, head_dim]."""
        num_kv_heads, page_size, head_dim = self._pool.page_shape()
        num_pages = -(-header.end // page_size) - header.start // page_size
        return host_buffer((num_kv_heads, num_pages, page_size, head_dim), self._pool.k[0].dtype)

    def _land_staged(self, header: KVBlockMsg, transfer: _Transfer, staged: torch.Tensor) -> None:
        """Copy a complete staged block into its reservation pages of the GPU pool (synchronous:
        the block counts as landed only once its bytes are in the pool)."""
        page_size = self._pool.page_size
        lo = (header.start - transfer.start) // page_size
        pages = torch.tensor(transfer.pages[lo:lo + staged.shape[1]], dtype=torch.int64)
        self._pool.import_pages(header.layer, header.kind, pages, staged)

    def _verify_tag(self, transfer_id: str, head: bytearray, tag: bytearray) -> None:
        """Count the record as its transfer's next, or close the stream: a record proves it was
        sealed by someone holding the key of a live (or recently ended) transfer, at its place."""
        transfer = self._transfers.get(transfer_id)
        seal = transfer.seal if transfer is not None else self._retired.get(transfer_id)
        if seal is not None and hmac.compare_digest(record_tag(seal.key, seal.num_records, head), tag):
            seal.num_records += 1
            return
        if is_active(Fault.SKIP_STREAM_TAG_CHECK):
            return
        self.refusals["bad_tag"] += 1
        raise _StreamBroken(f"a record for transfer {transfer_id[:64]!r} whose tag does not verify "
                            f"({'no such transfer' if seal is None else 'wrong key or place'})", refused=True)

    def _on_end(self, end: KVStreamEndMsg) -> None:
        transfer = self._transfers.get(end.transfer_id)
        if transfer is None:
            return  # cancelled or never authorized: nothing to settle
        if transfer.landing.num_bytes != end.num_bytes:
            self.refusals["short_payload"] += 1  # the commit's verification names what is missing
            logger.warning("transfer %s: the sender sent %d payload bytes, %d landed", end.transfer_id,
                           end.num_bytes, transfer.landing.num_bytes)
        self._settled.add(end.transfer_id)

    def _check(self, header: KVBlockMsg, num_bytes: int) -> str | None:
        transfer = self._transfers.get(header.transfer_id)
        if transfer is None:  # its tag verified: an ended transfer's (or the tag check is off)
            return CANCELLED if header.transfer_id in self._retired else "unauthorized_transfer"
        page_size = self._pool.page_size
        if not 0 <= header.layer < self._num_layers or header.kind not in KINDS:
            return "bad_block_address"
        # [0, start) is decode's prefix-cache hit: read-only pages no transfer may write
        if header.start % page_size or not transfer.start <= header.start < header.end <= \
                transfer.landing.num_positions:
            return "write_outside_reservation"
        num_kv_heads = self._pool.page_shape()[0]
        num_pages = -(-header.end // page_size) - header.start // page_size
        return None if num_bytes == num_kv_heads * num_pages * self._page_bytes else "bad_block_size"

    def _views(self, header: KVBlockMsg) -> list[memoryview]:
        """Where the block's payload lands, in its order: per KV head, the reservation's pages
        holding [start, end), one view per run of consecutive page ids (checked at authorize)."""
        transfer, page_size = self._transfers[header.transfer_id], self._pool.page_size
        lo = (header.start - transfer.start) // page_size  # indexes into the reservation's pages
        hi = -(-(header.end - transfer.start) // page_size)
        assert self._pool_bytes is not None, "a host pool's blocks land in place"
        whole = self._pool_bytes.layer(header.layer)[KINDS.index(header.kind)]
        pieces: list[tuple[int, int]] = []  # (byte offset in one head, length)
        for index, first_page, count in transfer.runs:
            a, b = max(lo, index), min(hi, index + count)
            if a < b:
                pieces.append(((first_page + a - index) * self._page_bytes, (b - a) * self._page_bytes))
        views = []
        for head in range(self._pool.page_shape()[0]):
            base = head * self._head_bytes
            views += [whole[base + offset:base + offset + length] for offset, length in pieces]
        return views

    def _landed(self, header: KVBlockMsg, num_bytes: int, staged: torch.Tensor | None = None) -> None:
        transfer = self._transfers.get(header.transfer_id)
        if transfer is None:
            return  # cancelled while it arrived (`cancel` turns the rest into a discard): never here
        if staged is not None:
            self._land_staged(header, transfer, staged)
        page_size = self._pool.page_size
        last = -(-(header.end - transfer.start) // page_size) - 1
        tail = header.end - transfer.start - last * page_size
        if tail < page_size:  # only [start, end) lands: the rest of the last page is zeroed
            target = self._pool.k[header.layer] if header.kind == "k" else self._pool.v[header.layer]
            target[:, transfer.pages[last], tail:] = 0
        transfer.landing.add(header.layer, header.kind, header.start, header.end, num_bytes)

