"""The built-in TCP transport: KV as frames on the prefill->decode link, before the commit.

Per layer the sender gathers the K and V of the pages holding positions [start, end) into one
reused staging buffer (one memmove per head and run of consecutive pages, zeros past `end`, so no
stale bytes leave the pool) and sends K and V as two `[KVBlockMsg, bytes]` messages without a
further copy: ZMQ reads the staging buffer itself, and the sender overwrites a buffer only
once ZMQ's tracker says it is done with it. A small ring of buffers lets the gather of the
next layers run while ZMQ sends the earlier ones. Frames travel on the same ordered connection
that carries the commit, so by the time decode reads the commit every write of the transfer
has landed; the pool's pages are never read by ZMQ, so they may be freed as soon as `push`
returns.

The receiver runs inside decode's engine loop: it copies a frame (straight from ZMQ's receive
buffer) into the pool only for an authorized transfer, only into that reservation's pages,
and records what landed. Because it is the only writer and runs on decode's own thread,
`cancel` is immediately final.
"""

from __future__ import annotations

import torch
import zmq

from kvseal.disagg.msgs import KVBlockMsg
from kvseal.disagg.transport import KINDS, Landing, PushPlan, TransportError, copy_pages
from kvseal.disagg.wire import PeerLinks
from kvseal.kvcache.pool import KVPool

NAME = "tcp"
NUM_STAGING_BUFFERS = 4  # layers staged ahead of the wire
SEND_TIMEOUT_S = 30.0  # a staging buffer ZMQ has not released by then: the link is stalled


class _Staging:
    """One reused buffer for a layer's K and V, and the trackers of the frames that read it."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.trackers: list[zmq.MessageTracker] = []

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, timeout_s: float) -> torch.Tensor:
        """A [2, *shape] tensor (K then V) over this buffer, once ZMQ no longer reads it."""
        for tracker in self.trackers:
            try:
                tracker.wait(timeout_s)
            except zmq.NotDone as exc:
                self.buffer, self.trackers = torch.empty(0, dtype=torch.uint8), []  # ZMQ keeps the old one alive
                raise TransportError(f"ZMQ did not send a KV frame within {timeout_s:g} s: the link is stalled") \
                    from exc
        self.trackers = []
        num_bytes = 2 * torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if self.buffer.numel() < num_bytes:
            self.buffer = torch.empty(num_bytes, dtype=torch.uint8)
        return self.buffer[:num_bytes].view(dtype).view(2, *shape)


class TcpSender:
    name = NAME

    def __init__(self, links: PeerLinks, timeout_s: float = SEND_TIMEOUT_S) -> None:
        self._links = links
        self._timeout_s = timeout_s
        self._staging = [_Staging() for _ in range(NUM_STAGING_BUFFERS)]
        self._turn = 0

    def push(self, plan: PushPlan, pool: KVPool) -> int:
        link = self._links.get(plan.kv_address)
        page_size, num_bytes = pool.page_size, 0
        for layer, end in enumerate(plan.written):
            first, last = plan.page_span(layer, page_size)
            if first == last:
                continue
            staged = self._stage(pool, layer, plan.src_pages[first:last], end - first * page_size)
            staging = self._staging[self._turn]
            for kind, data in zip(KINDS, staged):
                payload = data.view(torch.uint8).numpy().data
                tracker = link.send(KVBlockMsg(plan.transfer_id, layer, kind, first * page_size, end), payload)
                if tracker is not None:
                    staging.trackers.append(tracker)
                num_bytes += payload.nbytes
        return num_bytes

    def _stage(self, pool: KVPool, layer: int, pages: list[int], num_positions: int) -> torch.Tensor:
        """K and V of `pages` of one layer in the next staging buffer, zeroed past `num_positions`.
        -> [2, num_kv_heads, len(pages), page_size, head_dim]"""
        self._turn = (self._turn + 1) % len(self._staging)
        num_kv_heads, page_size, head_dim = pool.page_shape()
        staged = self._staging[self._turn].take((num_kv_heads, len(pages), page_size, head_dim), pool.k[layer].dtype,
                                                self._timeout_s)
        positions = list(range(len(pages)))
        copy_pages(staged[0], positions, pool.k[layer], pages)
        copy_pages(staged[1], positions, pool.v[layer], pages)
        staged[:, :, -1, num_positions - (len(pages) - 1) * page_size:] = 0  # nothing past `end`
        return staged

    def close(self) -> None:
        pass  # the links belong to the engine node


class TcpReceiver:
    name = NAME

    def __init__(self, pool: KVPool, num_layers: int, address: str) -> None:
        self._pool = pool
        self._num_layers = num_layers
        self._address = address
        self._pages: dict[str, list[int]] = {}
        self._starts: dict[str, int] = {}  # the first position each transfer may write
        self._landed: dict[str, Landing] = {}

    @property
    def address(self) -> str:
        return self._address

    def authorize(self, transfer_id: str, pages: list[int], start: int = 0) -> None:
        self._pages[transfer_id] = list(pages)
        self._starts[transfer_id] = start
        self._landed[transfer_id] = Landing(start + len(pages) * self._pool.page_size)

    def landed(self, transfer_id: str) -> Landing | None:
        return self._landed.get(transfer_id)

    def sender_done(self, transfer_id: str) -> None:
        pass  # frames and the commit share one ordered connection: nothing to wait for

    def close(self) -> None:
        pass

    def cancel(self, transfer_id: str) -> bool:
        self._pages.pop(transfer_id, None)
        self._starts.pop(transfer_id, None)
        self._landed.pop(transfer_id, None)
        return True  # this receiver is the only writer: nothing of the transfer can land now

    def deliver(self, header: KVBlockMsg, payload: memoryview) -> str | None:
        """Write one frame into the reservation's pages. Returns why it was refused, or None.
        `payload` must be writable (ZMQ's receive buffer): the padding past `end` is zeroed in it."""
        pages = self._pages.get(header.transfer_id)
        if pages is None:
            return "unauthorized_transfer"
        landing, base = self._landed[header.transfer_id], self._starts[header.transfer_id]
        why = self._check(header, landing, payload.nbytes, base)
        if why is not None:
            return why
        page_size = self._pool.page_size
        first, last = (header.start - base) // page_size, -(-(header.end - base) // page_size)  # in `pages`
        num_kv_heads, _, head_dim = self._pool.page_shape()
        data = torch.frombuffer(payload, dtype=self._pool.k[0].dtype)
        data = data.view(num_kv_heads, last - first, page_size, head_dim)
        data[:, -1, header.end - base - (last - 1) * page_size:] = 0  # only [start, end) may land
        target = self._pool.k[header.layer] if header.kind == "k" else self._pool.v[header.layer]
        copy_pages(target, pages[first:last], data, list(range(last - first)))
        landing.add(header.layer, header.kind, header.start, header.end, payload.nbytes)
        return None

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
