"""Decode's receiver under tensor parallelism: the transport's own receiver, writing rank 0's pool
of full pages (`parallel/handoff.py`), whose pages it zeroes once their transfer ends.

Every reservation ends through `cancel` (taken after a verified commit and its scatter to the
ranks, or released for any other reason); once the inner receiver answers that no write can still
land, the transfer's staged pages are zeroed, so no tenant's KV stays in the wire pool past its
handoff (the engine's own pools follow `--kv-scrub` as before).
"""

from __future__ import annotations

import socket
from collections import Counter

from kvseal.disagg.msgs import KVBlockMsg
from kvseal.disagg.transport import KVReceiver, Landing
from kvseal.parallel.handoff import RankHandoff


class StagedReceiver:
    """A `KVReceiver` over `handoff.wire` that zeroes a transfer's pages when it ends."""

    def __init__(self, inner: KVReceiver, handoff: RankHandoff) -> None:
        self.inner, self.handoff = inner, handoff
        self.name = inner.name
        self._pages: dict[str, list[int]] = {}

    @property
    def address(self) -> str:
        return self.inner.address

    def address_for(self, transfer_id: str) -> str:
        return self.inner.address_for(transfer_id)

    def authorize(self, transfer_id: str, pages: list[int], start: int = 0, *, key: bytes) -> None:
        self.inner.authorize(transfer_id, pages, start, key=key)
        self._pages[transfer_id] = list(pages)  # the reservation's own pages: positions [start, ...)

    def landed(self, transfer_id: str) -> Landing | None:
        return self.inner.landed(transfer_id)

    def progress(self) -> None:
        self.inner.progress()

    def sender_done(self, transfer_id: str) -> None:
        self.inner.sender_done(transfer_id)

    def settled(self, transfer_id: str) -> bool:
        return self.inner.settled(transfer_id)

    def take_refusals(self) -> Counter[str]:
        return self.inner.take_refusals()

    def fds(self) -> list[socket.socket]:
        return self.inner.fds()

    def deliver(self, header: KVBlockMsg, payload: list[memoryview]) -> str | None:
        return self.inner.deliver(header, payload)

    def cancel(self, transfer_id: str) -> bool:
        if not self.inner.cancel(transfer_id):
            return False
        self.handoff.clear(self._pages.pop(transfer_id, []))
        return True

    def close(self) -> None:
        self.inner.close()
