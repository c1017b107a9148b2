"""The built-in TCP transport: KV as frames on the prefill->decode link, before the commit.

Per layer and per K/V the sender sends one `[KVBlockMsg, frame...]` message whose payload
frames, in order, are each KV head's pages holding positions [start, end): runs of full pages
straight out of prefill's pool (ZMQ reads the pool in place, no gather), and the last page,
when partial, copied into a small staging buffer with zeros past `end` (no stale bytes leave
the pool). `push` returns only once ZMQ's trackers say it has read every frame, so the
request's pages may be freed right after. Frames travel on the same ordered connection that
carries the commit, so by the time decode reads the commit every write of the transfer has
landed.

The receiver runs inside decode's engine loop: it copies the frames (straight from ZMQ's
receive buffers) into the pool only for an authorized transfer, only into that reservation's
pages, and records what landed. Because it is the only writer and runs on decode's own
thread, `cancel` is immediately final; a frame of a transfer it cancelled a short while ago is
refused as `cancelled` (a client disconnect racing the push), any other unknown id as
`unauthorized_transfer`.
"""

from __future__ import annotations

import bisect
import ctypes
import socket
import time
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch
import zmq

from kvseal.disagg.msgs import KVBlockMsg
from kvseal.disagg.transport import (
    CANCELLED,
    KINDS,
    Landing,
    OneAddress,
    PushPlan,
    RecentlyEnded,
    RunsMemo,
    TransportError,
    check_pool_pages,
    copy_pages,
    page_runs,
)
from kvseal.disagg.wire import PeerLinks
from kvseal.kvcache.pool import KVPool

NAME = "tcp"
SEND_TIMEOUT_S = 30.0  # frames ZMQ has not sent by then: the link is stalled
# A message whose full pages form more runs than this is gathered into one frame first: with
# scattered pages, one zero-copy frame per page and head (23,040 of 4 KiB for a 2,048-token
# prompt) ran at 0.08x of raw ZMQ here, pyzmq's per-frame cost.
MAX_FRAME_RUNS = 8


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's memory, for ZMQ to read in place."""
    return t.view(torch.uint8).numpy().data


class TcpSender:
    name = NAME

    def __init__(self, links: PeerLinks, timeout_s: float = SEND_TIMEOUT_S,
                 max_frame_runs: int = MAX_FRAME_RUNS) -> None:
        self._links = links
        self._timeout_s = timeout_s
        self._max_frame_runs = max_frame_runs
        self._gather: torch.Tensor | None = None  # reused by every push (each waits until ZMQ read it)
        self._pool_bytes: PoolBytes | None = None

    def push(self, plan: PushPlan, pool: KVPool) -> int:
        link = self._links.get(plan.kv_address, plan.decode_key)
        page_size, num_bytes = pool.page_size, 0
        trackers: list[zmq.MessageTracker] = []
        tails: list[torch.Tensor] = []  # the staged partial pages: alive until ZMQ sent them
        gathered = _Gathered(lambda: self._gather_buffer(plan, pool))  # allocated on first use
        in_place = self._in_place(pool)
        for layer, first, pages, num_full in plan.sent_layers(page_size):
            end = plan.written[layer]
            runs = in_place.runs(pages[:num_full])
            for kind, source, whole in zip(KINDS, (pool.k[layer], pool.v[layer]), in_place.layer(layer)):
                if len(runs) > self._max_frame_runs:  # one frame per page and head would cost more than a gather
                    frames = [_bytes_of(gathered.take(source, pages, end % page_size))]
                else:
                    tail = self._tail(source, pages[-1], end % page_size) if num_full < len(pages) else None
                    frames = in_place.frames(whole, runs, tail)
                    if tail is not None:
                        tails.append(tail)
                tracker = link.send(KVBlockMsg(plan.transfer_id, layer, kind, first * page_size, end), frames)
                if tracker is not None:
                    trackers.append(tracker)
                num_bytes += sum(f.nbytes for f in frames)
        try:
            self._wait(trackers)
        except TransportError:
            self._gather = None  # ZMQ may still read it: the next push gets a new one
            raise
        return num_bytes

    def _in_place(self, pool: KVPool) -> PoolBytes:
        """The pool's tensors as flat bytes (made once per pool: its tensors never move)."""
        if self._pool_bytes is None or self._pool_bytes.pool is not pool:
            self._pool_bytes = PoolBytes(pool)
        return self._pool_bytes

    def _gather_buffer(self, plan: PushPlan, pool: KVPool) -> torch.Tensor:
        """The gather buffer, large enough for every page of the push (grown when it is not)."""
        num_kv_heads, page_size, head_dim = pool.page_shape()
        spans = [plan.page_span(layer, page_size) for layer in range(len(plan.written))]
        num_bytes = 2 * sum(last - first for first, last in spans) * num_kv_heads * page_size * head_dim * \
            pool.k[0].element_size()
        if self._gather is None or self._gather.numel() < num_bytes:
            self._gather = torch.empty(num_bytes, dtype=torch.uint8)
        return self._gather

    @staticmethod
    def _tail(source: torch.Tensor, page: int, num_positions: int) -> torch.Tensor:
        """A copy of one page of every head, zeroed from `num_positions` on. -> [kv_heads, page_size, head_dim]"""
        staged = source[:, page].clone()
        staged[:, num_positions:] = 0
        return staged

    def _wait(self, trackers: list[zmq.MessageTracker]) -> None:
        """Return once ZMQ read every frame (it reads prefill's pool in place until then)."""
        deadline = time.monotonic() + self._timeout_s
        for tracker in trackers:
            try:
                tracker.wait(max(0.0, deadline - time.monotonic()))
            except zmq.NotDone as exc:
                raise TransportError(f"ZMQ did not send the KV frames within {self._timeout_s:g} s: "
                                     "the link is stalled") from exc

    def close(self) -> None:
        pass  # the links belong to the engine node


class _Gathered:
    """Carves one push's gathered messages out of the gather buffer, one after the other."""

    def __init__(self, make_buffer: Callable[[], torch.Tensor]) -> None:
        self._make_buffer = make_buffer
        self._buffer: torch.Tensor | None = None
        self._offset = 0
        self._runs = RunsMemo()

    def take(self, source: torch.Tensor, pages: list[int], num_tail: int) -> torch.Tensor:
        """`pages` of every head of `source`, in order, the last page zeroed from `num_tail` on
        when it is partial (no stale bytes leave the pool). -> [kv_heads, len(pages), page_size, head_dim]"""
        shape = (source.shape[0], len(pages), *source.shape[2:])
        num_bytes = source[:, :1].numel() * len(pages) * source.element_size()
        if self._buffer is None:
            self._buffer = self._make_buffer()
        staged = self._buffer[self._offset:self._offset + num_bytes].view(source.dtype).view(shape)
        self._offset += num_bytes
        copy_pages(staged, list(range(len(pages))), source, pages, self._runs)
        if num_tail:
            staged[:, -1, num_tail:] = 0
        return staged


class PoolBytes:
    """One pool's K and V tensors as flat byte views, for frames that ZMQ reads in place: a
    frame is a slice of a view (each holds its tensor alive), far cheaper to make per push than
    a torch slice of every head and run (180 per push of a 2,048-token prompt here)."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self._k = [flat_bytes(t) for t in pool.k]
        self._v = [flat_bytes(t) for t in pool.v]
        self._page_bytes = pool.k[0][0, 0].numel() * pool.k[0].element_size()
        self._head_bytes = pool.num_pages * self._page_bytes
        self._runs = RunsMemo()

    def layer(self, layer: int) -> tuple[memoryview, memoryview]:
        return self._k[layer], self._v[layer]

    def runs(self, full_pages: list[int]) -> list[tuple[int, int]]:
        """Runs of consecutive pages as byte ranges of one head, (offset, length)."""
        return [(full_pages[index] * self._page_bytes, count * self._page_bytes)
                for index, count in self._runs(full_pages, full_pages)]

    def frames(self, whole: memoryview, runs: list[tuple[int, int]], tail: torch.Tensor | None) -> list[memoryview]:
        """Per KV head, in order: its runs of full pages as slices of `whole` (one K or V tensor
        [kv_heads, num_pages, page_size, head_dim] as bytes), then the staged tail page."""
        frames: list[memoryview] = []
        for head in range(self.pool.k[0].shape[0]):
            base = head * self._head_bytes
            frames += [whole[base + offset:base + offset + length] for offset, length in runs]
            if tail is not None:
                frames.append(_bytes_of(tail[head]))
        return frames


def flat_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's memory as a flat byte view (slices of it are views too)."""
    return t.view(torch.uint8).reshape(-1).numpy().data


class TcpReceiver(OneAddress):
    name = NAME

    def __init__(self, pool: KVPool, num_layers: int, address: str) -> None:
        self._pool = pool
        self._num_layers = num_layers
        self._address = address
        self._pages: dict[str, list[int]] = {}
        self._runs: dict[str, list[tuple[int, int, int]]] = {}  # page_runs of each transfer's pages
        self._starts: dict[str, int] = {}  # the first position each transfer may write
        self._landed: dict[str, Landing] = {}
        self._cancelled: RecentlyEnded[None] = RecentlyEnded()  # their late frames are refused as `CANCELLED`

    def authorize(self, transfer_id: str, pages: list[int], start: int = 0, *, key: bytes) -> None:
        """`key` is not needed here: KV frames arrive on the CURVE link of an authenticated peer
        (encrypted and authenticated by it), under the transfer id."""
        check_pool_pages(self._pool, pages)
        self._pages[transfer_id] = list(pages)
        self._runs[transfer_id] = page_runs(pages)
        self._starts[transfer_id] = start
        self._landed[transfer_id] = Landing(start + len(pages) * self._pool.page_size)

    def landed(self, transfer_id: str) -> Landing | None:
        return self._landed.get(transfer_id)

    def progress(self) -> None:
        pass  # frames arrive on the control channel: `deliver` took them in

    def sender_done(self, transfer_id: str) -> None:
        pass  # frames and the commit share one ordered connection: nothing to wait for

    def settled(self, transfer_id: str) -> bool:
        return True  # frames and the commit share one ordered connection

    def take_refusals(self) -> Counter[str]:
        return Counter()  # every refusal is `deliver`'s answer

    def fds(self) -> list[socket.socket]:
        return []  # frames arrive on the engine's ROUTER

    def close(self) -> None:
        pass

    def cancel(self, transfer_id: str) -> bool:
        if self._pages.pop(transfer_id, None) is not None:
            self._cancelled.add(transfer_id, None)
        self._runs.pop(transfer_id, None)
        self._starts.pop(transfer_id, None)
        self._landed.pop(transfer_id, None)
        return True  # this receiver is the only writer: nothing of the transfer can land now

    def deliver(self, header: KVBlockMsg, payload: list[memoryview]) -> str | None:
        """Write one message's frames into the reservation's pages. Returns why it was refused,
        or None. The frames hold, in order, each KV head's pages of [start, end), each frame
        whole pages of one head; only [start, end) lands (the rest of the last page is zeroed)."""
        pages = self._pages.get(header.transfer_id)
        if pages is None:
            return CANCELLED if header.transfer_id in self._cancelled else "unauthorized_transfer"
        landing, base = self._landed[header.transfer_id], self._starts[header.transfer_id]
        num_bytes = sum(frame.nbytes for frame in payload)
        why = self._check(header, landing, num_bytes, base)
        if why is not None:
            return why
        page_size = self._pool.page_size
        first, last = (header.start - base) // page_size, -(-(header.end - base) // page_size)  # in `pages`
        pieces = self._pieces(payload, last - first)
        if pieces is None:
            return "bad_block_size"
        target = self._pool.k[header.layer] if header.kind == "k" else self._pool.v[header.layer]
        _copy_pieces(target, self._runs[header.transfer_id], first, pieces, payload)
        tail = header.end - base - (last - 1) * page_size
        if tail < page_size:
            target[:, pages[last - 1], tail:] = 0  # only [start, end) lands
        landing.add(header.layer, header.kind, header.start, header.end, num_bytes)
        return None

    def _pieces(self, payload: list[memoryview], num_pages: int) -> list[tuple[int, int, int, int, int]] | None:
        """The frames read as one [kv_heads, num_pages, page_size, head_dim] array, cut at head
        boundaries: (frame, first page in the frame, head, first page, page count) per piece.
        None unless every frame is whole pages (checked before a byte moves)."""
        num_kv_heads, page_size, head_dim = self._pool.page_shape()
        page_bytes = page_size * head_dim * self._pool.k[0].element_size()
        if any(frame.nbytes == 0 or frame.nbytes % page_bytes for frame in payload):
            return None
        pieces, position = [], 0  # position: pages of the whole array consumed so far
        for index, frame in enumerate(payload):
            offset, left = 0, frame.nbytes // page_bytes
            while left:
                head, page = divmod(position, num_pages)
                count = min(left, num_pages - page)
                pieces.append((index, offset, head, page, count))
                offset, left, position = offset + count, left - count, position + count
        return pieces if position == num_kv_heads * num_pages else None

    def _check(self, header: KVBlockMsg, landing: Landing, num_bytes: int, base: int) -> str | None:
        page_size = self._pool.page_size
        if not 0 <= header.layer < self._num_layers or header.kind not in KINDS:
            return "bad_block_address"
        # [0, base) is decode's prefix-cache hit: read-only pages no transfer may write
        if header.start % page_size or not base <= header.start < header.end <= landing.num_positions:
            return "write_outside_reservation"
        num_kv_heads, _, head_dim = self._pool.page_shape()
        num_pages = -(-header.end // page_size) - header.start // page_size
        expected = num_kv_heads * num_pages * page_size * head_dim * self._pool.k[0].element_size()
        return None if num_bytes == expected else "bad_block_size"


def _copy_pieces(target: torch.Tensor, runs: list[tuple[int, int, int]], first: int,
                 pieces: list[tuple[int, int, int, int, int]], payload: list[memoryview]) -> None:
    """Copy each piece (frame, first page in the frame, head, first page, page count; pages
    counted from `first` in the reservation) into `target` [kv_heads, num_pages, page_size,
    head_dim] at the reservation's pages, `runs` (its `page_runs`, ids checked against the pool
    when authorized): one memmove per piece and run of consecutive pages, straight from ZMQ's
    buffers, on this thread."""
    page_bytes = target[0, 0].numel() * target.element_size()
    head_bytes = target.shape[1] * page_bytes
    target_ptr = target.data_ptr()
    sources = [np.frombuffer(frame, dtype=np.uint8).ctypes.data for frame in payload]
    starts = [index for index, _, _ in runs]
    for frame, offset, head, page, count in pieces:
        lo, hi = first + page, first + page + count  # indexes into the reservation's pages
        source = sources[frame] + (offset - lo) * page_bytes  # page index i is at source + i * page_bytes
        for index, first_page, run_count in runs[bisect.bisect_right(starts, lo) - 1:]:
            if index >= hi:
                break
            a, b = max(lo, index), min(hi, index + run_count)
            ctypes.memmove(target_ptr + head * head_bytes + (first_page + a - index) * page_bytes,
                           source + a * page_bytes, (b - a) * page_bytes)
