"""Page ownership, replayed on every tensor-parallel rank.

Under tensor parallelism the allocator and the ownership records live in one place (the
driver, rank 0), and every rank holds its shard of every page. For each rank to check its own
forwards (I3, I4) against its own writes, the driver logs every change of ownership, in order,
as typed events (`LoggedRecords`, and the scrub/poison fills of the pool); each worker replays
them on its own `WriteRecords` and pool (`replay`) before the next step. A worker's written
prefixes advance only by its own pool's writes, so its check refuses what its own pool does
not hold, whatever rank 0's records say.
"""

from __future__ import annotations

import logging

import msgspec

from kvseal.errors import IsolationViolation
from kvseal.kvcache.pool import KVPool
from kvseal.kvcache.records import RecordKernels, WriteRecords

logger = logging.getLogger("kvseal")


class HandOutEvent(msgspec.Struct, tag="hand_out"):
    request_id: str
    pages: list[int]
    generations: list[int]
    namespace: str


class ShareEvent(msgspec.Struct, tag="share"):
    request_id: str
    namespace: str
    num_pages: int


class PublishEvent(msgspec.Struct, tag="publish"):
    request_id: str
    page: int
    page_index: int
    namespace: str


class EvictEvent(msgspec.Struct, tag="evict"):
    pages: list[int]


class TakeBackEvent(msgspec.Struct, tag="take_back"):
    request_id: str
    pages: list[int]


class FillEvent(msgspec.Struct, tag="fill"):
    pages: list[int]
    value: float


OwnershipEvent = HandOutEvent | ShareEvent | PublishEvent | EvictEvent | TakeBackEvent | FillEvent


class LoggedRecords(WriteRecords):
    """`WriteRecords` that also log every ownership change (once it succeeded) for the other ranks."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, track_slots: bool,
                 kernels: RecordKernels | None = None) -> None:
        super().__init__(num_layers, num_pages, page_size, track_slots, kernels)
        self.events: list[OwnershipEvent] = []

    def drain(self) -> list[OwnershipEvent]:
        """The events since the last drain, oldest first."""
        events, self.events = self.events, []
        return events

    def hand_out(self, request_id: str, pages: list[int], generations: list[int], namespace: str = "") -> None:
        super().hand_out(request_id, pages, generations, namespace)
        self.events.append(HandOutEvent(request_id, list(pages), list(generations), namespace))

    def share(self, request_id: str, namespace: str, num_pages: int) -> None:
        super().share(request_id, namespace, num_pages)
        self.events.append(ShareEvent(request_id, namespace, num_pages))

    def publish(self, request_id: str, page: int, page_index: int, namespace: str) -> None:
        super().publish(request_id, page, page_index, namespace)
        self.events.append(PublishEvent(request_id, page, page_index, namespace))

    def evict(self, pages: list[int]) -> None:
        super().evict(pages)
        self.events.append(EvictEvent(list(pages)))

    def take_back(self, request_id: str, pages: list[int]) -> None:
        super().take_back(request_id, pages)
        self.events.append(TakeBackEvent(request_id, list(pages)))

    def log_fill(self, pages: list[int], value: float) -> None:
        self.events.append(FillEvent(list(pages), value))


def replay(events: list[OwnershipEvent], records: WriteRecords, pool: KVPool) -> None:
    """Apply the driver's events, in order, to a worker's records and pool shard."""
    for event in events:
        if isinstance(event, HandOutEvent):
            records.hand_out(event.request_id, event.pages, event.generations, event.namespace)
        elif isinstance(event, ShareEvent):
            records.share(event.request_id, event.namespace, event.num_pages)
        elif isinstance(event, PublishEvent):
            _publish(records, event)
        elif isinstance(event, EvictEvent):
            records.evict(event.pages)
        elif isinstance(event, TakeBackEvent):
            records.take_back(event.request_id, event.pages)
        else:
            pool.fill(event.pages, event.value)


def _publish(records: WriteRecords, event: PublishEvent) -> None:
    """A page this rank did not write in full stays its request's own here: no reader of the
    cached page on the driver passes this rank's check (I3), so the fault fails closed."""
    try:
        records.publish(event.request_id, event.page, event.page_index, event.namespace)
    except IsolationViolation as violation:
        logger.error("tensor-parallel rank refuses to publish a page it did not write: %s", violation)
