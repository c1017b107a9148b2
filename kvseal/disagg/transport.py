"""The KV transport interface: how prompt KV moves from prefill's pool into decode's pages.

Two sides, each small:

- `KVReceiver` (decode) authorizes exactly the pages of one reservation per transfer id and
  refuses every other write; records what actually landed, per (layer, K/V, position range);
  and `cancel(transfer_id)` answers True only once no write of that transfer can still land
  (after which the pages may be released, I6).
- `KVSender` (prefill) pushes positions [start, n) of each layer of a request's pages, where n
  is what prefill's own write records say it wrote, never what it believes it computed, and
  `start` is where decode's prefix-cache hit ends (decode already holds [0, start)).

Decode trusts neither the sender's claim nor the sender: it compares the commit against its
receiver's landing records (`verify.py`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvseal.disagg.msgs import KVBlockMsg, KVKind
from kvseal.errors import KvsealError
from kvseal.kvcache.pool import KVPool

KINDS: tuple[KVKind, KVKind] = ("k", "v")


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


@dataclass(frozen=True)
class PushPlan:
    """One push from prefill: positions [start, written[layer]) of each layer, read from
    `src_pages` (prefill's pages, position order), into the reservation behind `transfer_id`.

    `dest_pages` are decode's pages in position order from position 0; `start` is page-aligned
    and positions before it are not sent: decode already holds them (its prefix-cache hit, in
    read-only pages no transfer may write)."""

    transfer_id: str
    src_pages: list[int]
    written: list[int]
    kv_address: str
    dest_pages: list[int]
    start: int = 0


class KVReceiver(Protocol):
    name: str

    @property
    def address(self) -> str:
        """Where senders deliver KV for this engine (sent to prefill in `ReservedMsg`)."""
        ...

    def authorize(self, transfer_id: str, pages: list[int], start: int = 0) -> None:
        """Accept writes for `transfer_id` into exactly `pages`, which hold positions [start, ...)
        in order (`start` page-aligned: what lies before it is decode's read-only cache hit);
        refuse everything else, any write before `start` included."""
        ...

    def landed(self, transfer_id: str) -> Landing | None:
        """What landed for an authorized transfer (None for an unknown id)."""
        ...

    def sender_done(self, transfer_id: str) -> None:
        """Prefill sent its commit or abort, which it does only once its writes are terminal."""
        ...

    def deliver(self, header: KVBlockMsg, payload: memoryview) -> str | None:
        """A KV frame on the control channel (the TCP transport's data); why it was refused, or None."""
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
        raises only once no write of the push can still land (prefill commits or aborts next)."""
        ...

    def close(self) -> None: ...


def staged_pages(pool: KVPool, src_pages: list[int], layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the pages holding positions [0, end) of one layer, contiguous
    [num_kv_heads, n, page_size, head_dim], zeroed past `end` (no stale bytes leave the pool)."""
    page_size = pool.page_size
    num_pages = -(-end // page_size)
    k, v = pool.export_pages(layer, torch.tensor(src_pages[:num_pages], dtype=torch.int64))
    tail = end - (num_pages - 1) * page_size
    if tail < page_size:
        k[:, -1, tail:] = 0
        v[:, -1, tail:] = 0
    return k, v
