"""The KV transport interface: how prompt KV moves from prefill's pool into decode's pages.

Two sides, each small:

- `KVReceiver` (decode) authorizes exactly the pages of one reservation per transfer id and
  refuses every other write; records what actually landed, per (layer, K/V, position range);
  and `cancel(transfer_id)` answers True only once no write of that transfer can still land
  (after which the pages may be released, I6).
- `KVSender` (prefill) pushes positions [start, n) of each layer of a request's pages, where n
  is what prefill's own write records say it wrote, never what it believes it computed, and
  `start` is where decode's prefix-cache hit ends (decode already holds [0, start), page-aligned).
  What it sends never carries a byte of the pool past n (the last page's tail is zeroed, or
  never leaves the pool), and a push returns only once nothing it sends is still read from
  prefill's pool: the request's pages may be freed and reused right after.

Decode trusts neither the sender's claim nor the sender: it compares the commit against its
receiver's landing records (`verify.py`).

A write refused because its transfer ended here a short while ago (cancelled: the client went
away, an abort, an expiry) is refused as `CANCELLED`, the benign reason; one for a transfer this
receiver never authorized (or ended too long ago to remember, `RecentlyEnded`) keeps its alarm
reason. Either way nothing of it lands.
"""

from __future__ import annotations

import ctypes
import logging
import socket
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

import numpy as np
import torch

from kvseal.disagg.msgs import KVBlockMsg, KVKind
from kvseal.errors import KvsealError
from kvseal.kvcache.pool import KVPool

logger = logging.getLogger("kvseal.disagg")

KINDS: tuple[KVKind, KVKind] = ("k", "v")
# `copy_pages` does one memmove per head and run up to this many runs, and numpy's indexed copy
# (one C loop) past it: 23,040 one-page memmoves through ctypes cost ~60 ms here, np.take ~10.
MAX_MEMMOVE_RUNS = 16
# The refusal reason (a metrics label) of a write or commit that arrives for a transfer decode
# ended a short while ago: a client disconnect or abort racing the handoff, not an attack.
CANCELLED = "cancelled"
MAX_RECENTLY_ENDED = 4096  # ended transfers remembered per receiver or table (the oldest forgotten first)

V = TypeVar("V")


class TransportError(KvsealError):
    """A transfer could not be made (peer unreachable, connection refused or reset)."""


@dataclass
class Landing:
    """What landed for one transfer: per (layer, kind), the position ranges written."""

    num_positions: int  # the reservation's pages x page_size: nothing may land past it
    ranges: dict[tuple[int, KVKind], list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    num_bytes: int = 0

    def add(self, layer: int, kind: KVKind, start: int, end: int, num_bytes: int) -> None:
        self.ranges[(layer, kind)].append((start, end))
        self.num_bytes += num_bytes

    def covered_prefix(self, layer: int, kind: KVKind) -> int:
        """How many leading positions of `layer`/`kind` landed (gaps end the prefix)."""
        prefix = 0
        for start, end in sorted(self.ranges.get((layer, kind), [])):
            if start > prefix:
                break
            prefix = max(prefix, end)
        return prefix


class RecentlyEnded(Generic[V]):
    """The transfers that ended here last, newest last, at most `max_len` of them (adding one
    more forgets the oldest), each with what its owner keeps of it. Tells a late write or commit of
    a transfer decode itself ended (refused as `CANCELLED`) from one of a transfer it never knew
    (refused as an alarm); memory stays bounded however many transfers end."""

    def __init__(self, max_len: int = MAX_RECENTLY_ENDED) -> None:
        assert max_len > 0
        self.max_len = max_len
        self._ended: OrderedDict[str, V] = OrderedDict()

    def add(self, transfer_id: str, value: V) -> None:
        self._ended[transfer_id] = value
        self._ended.move_to_end(transfer_id)
        while len(self._ended) > self.max_len:
            self._ended.popitem(last=False)

    def get(self, transfer_id: str) -> V | None:
        return self._ended.get(transfer_id)

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self._ended

    def __len__(self) -> int:
        return len(self._ended)


def log_refused_block(transfer_id: str, why: str) -> None:
    """Log a refused KV block: at INFO when its transfer ended here (`CANCELLED`, benign), else at
    WARNING with the alarm reason."""
    if why == CANCELLED:
        logger.info("dropped a late KV block for transfer %s: the transfer was cancelled here", transfer_id)
    else:
        logger.warning("refused a KV block for transfer %s: %s", transfer_id, why)


@dataclass(frozen=True)
class PushPlan:
    """One push from prefill: positions [start, written[layer]) of each layer, read from
    `src_pages` (prefill's pages, position order), into the reservation behind `transfer_id`.

    `dest_pages` are decode's pages in position order from position 0; `start` is page-aligned
    and positions before it are not sent: decode already holds them (its prefix-cache hit, in
    read-only pages no transfer may write).
    A layer with `written[layer] <= start` sends nothing."""

    transfer_id: str
    src_pages: list[int]
    written: list[int]
    kv_address: str
    dest_pages: list[int]
    start: int = 0
    # The transfer's secret (`ReservedMsg.transfer_key`): tcp-stream seals each record with it,
    # NIXL derives its arena tags from it.
    transfer_key: bytes = field(kw_only=True, repr=False)
    # The CURVE key decode proves on its control link (the tcp transport's frames ride it).
    decode_key: bytes = field(kw_only=True)

    def __post_init__(self) -> None:
        if self.start < 0:
            raise ValueError(f"a push starts at a position >= 0, got {self.start}")

    def page_span(self, layer: int, page_size: int) -> tuple[int, int]:
        """[first, last) indexes into the page lists that hold layer's positions [start, end)
        (empty when nothing of the layer is sent)."""
        end = self.written[layer]
        if end <= self.start:
            return 0, 0
        return self.start // page_size, -(-end // page_size)

    def sent_layers(self, page_size: int) -> Iterator[tuple[int, int, list[int], int]]:
        """(layer, first, its source pages holding [start, end), how many of them are full) for
        each layer that sends something (`first`: as in `page_span`); a page past the full ones
        holds end % page_size positions."""
        for layer, end in enumerate(self.written):
            first, last = self.page_span(layer, page_size)
            if first == last:
                continue
            pages = self.src_pages[first:last]
            yield layer, first, pages, len(pages) if end % page_size == 0 else len(pages) - 1


class KVReceiver(Protocol):
    name: str

    @property
    def address(self) -> str:
        """Where senders reach this engine's KV receiver."""
        ...

    def address_for(self, transfer_id: str) -> str:
        """Where prefill delivers an authorized transfer's KV (sent to it in `ReservedMsg`): the
        receiver's address, plus whatever the transport needs to know of this transfer."""
        ...

    def authorize(self, transfer_id: str, pages: list[int], start: int = 0, *, key: bytes) -> None:
        """Accept writes for `transfer_id` into exactly `pages`, which hold positions [start, ...)
        in order (`start` page-aligned: what lies before it is decode's read-only cache hit);
        refuse everything else, any write before `start` included. `key` is the transfer's
        secret: a transport whose data does not ride an authenticated link accepts only writes
        that prove it."""
        ...

    def landed(self, transfer_id: str) -> Landing | None:
        """What landed for an authorized transfer (None for an unknown id)."""
        ...

    def progress(self) -> None:
        """Take in whatever landed outside the control channel since the last call (decode's
        loop calls it every iteration); cheap when nothing did."""
        ...

    def sender_done(self, transfer_id: str) -> None:
        """No write of `transfer_id` is still to come: prefill sent its commit or abort, which it
        does only once its writes are terminal, or the frontend says no prefill engine was ever
        given the transfer (`AbortUnsentMsg`)."""
        ...

    def settled(self, transfer_id: str) -> bool:
        """Whether every write prefill made before its commit has been taken in, so the commit may
        be verified now (tcp-stream: the data stream can lag the commit; the others: always)."""
        ...

    def take_refusals(self) -> Counter[str]:
        """Why writes were refused outside `deliver` since the last call (metrics labels)."""
        ...

    def fds(self) -> list[socket.socket]:
        """The receiver's own sockets, whose data should wake decode's loop (none: it has none)."""
        ...

    def deliver(self, header: KVBlockMsg, payload: list[memoryview]) -> str | None:
        """A KV message's payload frames on the control channel (the TCP transport's data); why
        it was refused, or None."""
        ...

    def cancel(self, transfer_id: str) -> bool:
        """Stop accepting writes for `transfer_id` and forget it. True when no write of it can
        land any more (the pages may be released); False: ask again later."""
        ...

    def close(self) -> None: ...


class KVSender(Protocol):
    name: str

    def push(self, plan: PushPlan, pool: KVPool) -> int:
        """Move the planned KV; returns the bytes sent. Raises `TransportError`. Returns or
        raises only once no write of the push can still land and nothing of `pool` is still
        read for it (prefill commits or aborts next, and may free and reuse the pages)."""
        ...

    def close(self) -> None: ...


class OneAddress:
    """For receivers reached at one address by every transfer (each record or frame names its
    transfer in its header)."""

    _address: str

    @property
    def address(self) -> str:
        return self._address

    def address_for(self, transfer_id: str) -> str:
        return self._address


def check_pool_pages(pool: KVPool, pages: list[int]) -> None:
    """Receivers authorize only pages of their own pool."""
    if not all(0 <= page < pool.num_pages for page in pages):
        raise ValueError(f"pages outside the pool of {pool.num_pages}: {pages}")


def page_runs(pages: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive page ids: (index into `pages`, first page id, number of pages)."""
    runs: list[tuple[int, int, int]] = []
    for index, page in enumerate(pages):
        if runs and runs[-1][1] + runs[-1][2] == page:
            offset, first, count = runs[-1]
            runs[-1] = (offset, first, count + 1)
        else:
            runs.append((index, page, 1))
    return runs


def copy_pages(target: torch.Tensor, target_pages: list[int], source: torch.Tensor, source_pages: list[int],
               runs: RunsMemo | None = None) -> None:
    """target[:, target_pages[i]] = source[:, source_pages[i]], for contiguous tensors of one
    dtype [num_kv_heads, num_pages, page_size, head_dim] (page counts may differ).

    One memmove per head and run of pages consecutive on both sides (past `MAX_MEMMOVE_RUNS`
    runs, numpy's indexed copy instead), on this thread: torch's
    own copy splits a copy this size across its intra-op threads, which on a loaded host (more
    runnable threads than cores) made it 100x slower here. Page ids are checked against both
    tensors before any byte moves. `runs`: a memo for the runs, shared by the calls of one push
    or import (their page lists are usually the same)."""
    assert target.is_contiguous() and source.is_contiguous() and target.dtype == source.dtype
    assert target.shape[0] == source.shape[0] and target.shape[2:] == source.shape[2:]
    assert len(target_pages) == len(source_pages)
    if not target_pages:
        return
    num_kv_heads, num_target, num_source = target.shape[0], target.shape[1], source.shape[1]
    if not (0 <= min(target_pages) and max(target_pages) < num_target
            and 0 <= min(source_pages) and max(source_pages) < num_source):
        raise IndexError(f"page ids out of range: target pages < {num_target}, source pages < {num_source}")
    joint = (runs or joint_runs)(target_pages, source_pages)
    if len(joint) > MAX_MEMMOVE_RUNS:
        _copy_scattered(target, target_pages, source, source_pages)
        return
    page_bytes = target[0, 0].numel() * target.element_size()
    target_ptr, source_ptr = target.data_ptr(), source.data_ptr()
    for index, count in joint:
        for head in range(num_kv_heads):
            ctypes.memmove(target_ptr + (head * num_target + target_pages[index]) * page_bytes,
                           source_ptr + (head * num_source + source_pages[index]) * page_bytes, count * page_bytes)


def zero_pages(target: torch.Tensor, pages: list[int]) -> None:
    """target[:, pages] = 0, for a contiguous tensor [rows, num_pages, ...] of any dtype (rows: the
    kv heads of one layer's K or V, or every layer's K and V heads at once, flattened).

    One memset per row and run of consecutive pages (past `MAX_MEMMOVE_RUNS` runs, numpy's
    indexed assignment instead), on this thread, for the reason `copy_pages` gives. Page ids are
    checked before any byte is written."""
    assert target.is_contiguous() and target.dim() >= 2
    if not pages:
        return
    num_rows, num_pages = target.shape[0], target.shape[1]
    if not (0 <= min(pages) and max(pages) < num_pages):
        raise IndexError(f"page ids out of range: pages < {num_pages}")
    runs = page_runs(pages)
    if len(runs) > MAX_MEMMOVE_RUNS:
        target.reshape(num_rows, num_pages, -1).view(torch.uint8).numpy()[:, pages] = 0  # (a view: contiguous)
        return
    page_bytes = target[0, 0].numel() * target.element_size()
    target_ptr = target.data_ptr()
    for _, first, count in runs:
        for row in range(num_rows):
            ctypes.memset(target_ptr + (row * num_pages + first) * page_bytes, 0, count * page_bytes)


def _copy_scattered(target: torch.Tensor, target_pages: list[int], source: torch.Tensor,
                    source_pages: list[int]) -> None:
    """`copy_pages` for many runs (ids checked by the caller): numpy's indexed copies, one C loop,
    on this thread, on byte views (any dtype, bfloat16 too). One gather or scatter pass when one
    side is a range of consecutive pages (a staging buffer, an arena run), else two."""
    target_bytes, source_bytes = target.view(torch.uint8).numpy(), source.view(torch.uint8).numpy()
    n = len(target_pages)
    if target_pages == list(range(target_pages[0], target_pages[0] + n)):
        # ids checked already: "clip" never clips, and unlike "raise" it writes `out` unbuffered
        np.take(source_bytes, source_pages, axis=1, out=target_bytes[:, target_pages[0]:target_pages[0] + n],
                mode="clip")
    elif source_pages == list(range(source_pages[0], source_pages[0] + n)):
        target_bytes[:, target_pages] = source_bytes[:, source_pages[0]:source_pages[0] + n]
    else:
        target_bytes[:, target_pages] = source_bytes[:, source_pages]


def joint_runs(a: list[int], b: list[int]) -> list[tuple[int, int]]:
    """Runs of indexes over which both `a` and `b` are consecutive ids: (first index, count)."""
    runs: list[tuple[int, int]] = []
    for i in range(len(a)):
        if runs and a[i] == a[i - 1] + 1 and b[i] == b[i - 1] + 1:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


class RunsMemo:
    """`joint_runs` that keeps its last answer: the layers, K/V and heads of one push or import
    usually ask for the same page lists, and the runs are a Python loop over every page (about
    180 of them per push of a 2,048-token prompt here, several ms)."""

    def __init__(self) -> None:
        self._last: tuple[list[int], list[int], list[tuple[int, int]]] | None = None

    def __call__(self, a: list[int], b: list[int]) -> list[tuple[int, int]]:
        if self._last is None or self._last[0] != a or self._last[1] != b:
            self._last = (list(a), list(b), joint_runs(a, b))
        return self._last[2]
