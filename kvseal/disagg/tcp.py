"""The built-in TCP transport: KV as frames on the prefill->decode link, before the commit.

The sender stages each layer's K and V of the written pages into one contiguous buffer each
and sends it as `[KVBlockMsg, bytes]` on the same ordered connection that carries the commit,
so by the time decode reads the commit every write of the transfer has landed. The receiver
runs inside decode's engine loop: it copies a frame into the pool only for an authorized
transfer, only into that reservation's pages, and records what landed. Because it is the
only writer and runs on decode's own thread, `cancel` is immediately final.
"""

from __future__ import annotations

import torch

from kvseal.disagg.msgs import KVBlockMsg
from kvseal.disagg.transport import KINDS, Landing, PushPlan, staged_pages
from kvseal.disagg.wire import PeerLinks
from kvseal.kvcache.pool import KVPool

NAME = "tcp"


class TcpSender:
    name = NAME

    def __init__(self, links: PeerLinks) -> None:
        self._links = links

    def push(self, plan: PushPlan, pool: KVPool) -> int:
        link = self._links.get(plan.kv_address)
        num_bytes = 0
        first = plan.start // pool.page_size  # decode already holds [0, start): not sent
        for layer, end in enumerate(plan.written):
            if end <= plan.start:
                continue
            for kind, data in zip(KINDS, staged_pages(pool, plan.src_pages[first:], layer, end - plan.start)):
                payload = data.view(torch.uint8).numpy().data
                link.send(KVBlockMsg(plan.transfer_id, layer, kind, plan.start, end), payload)
                num_bytes += payload.nbytes
        return num_bytes

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
        self._pool.import_pages(header.layer, header.kind, torch.tensor(pages[first:last]), data)
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
