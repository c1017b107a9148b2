"""Decode's reservation table: pages in the "receiving" state
(docs/ARCHITECTURE.md, "The handoff, as implemented": steps 1, 4, 5).

A reservation owns its pages in the allocator under its request id and tenant, but is not a
running request: the scheduler never sees it, so it is never preempted and its pages are
never handed to anyone else. It leaves the table only by

- `take` (the commit verified: the pages pass to the running request), or
- `release` (abort, refusal, failed verification, cancellation, expiry), which frees the
  pages only once the receiver confirms no write of the transfer can still land; until then
  the reservation stays, marked releasing, and `retry_releases` asks again.

A reservation that hears nothing of its prefill before its deadline is expired under the same
rule. The deadline is `timeout_s` after the last sign of progress: the reservation's placing, a
keepalive from prefill (`restart_deadline`), more KV landed (seen by `expired` at the deadline). So it catches a
prefill that stopped (died, lost the request, hung), never one that is slow or queued.
Reservations that cannot get pages yet wait in FIFO order (they hold nothing while waiting).
The table remembers the last `MAX_RECENTLY_ENDED` released transfers (`released`), so decode
tells a commit that arrives after its reservation ended (a client disconnect racing the
handoff) from a commit for a transfer it never reserved.

Prefix cache (I5): when a reservation gets its pages it first takes its hit in the prefix
cache, in the namespace decode derives from the reservation's tenant (`namespace_of`; the
tenant comes only from an authenticated frontend, I9): the cached pages
holding the prompt's leading full pages, shared read-only (a reader reference each, so they
cannot be evicted while it holds them). Its own pages follow; the receiver is authorized for
the own pages only, from the hit's end on, so no transfer can write a cached page. Every way
out (`take` hands the references to the running request; `release` drops them with the own
pages in `KVCacheManager.free`) keeps the reference counts exact.
"""

from __future__ import annotations

import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvseal.disagg.msgs import TRANSFER_KEY_BYTES
from kvseal.disagg.transport import KVReceiver, RecentlyEnded
from kvseal.kvcache.manager import KVCacheManager
from kvseal.types import Request, SamplingParams, namespace_of


@dataclass
class Reservation:
    request_id: str
    tenant: str
    prompt_token_ids: list[int]
    params: SamplingParams
    frontend: bytes  # who asked (a ROUTER identity): replies and outputs go there
    transfer_id: str = ""
    transfer_key: bytes = field(default=b"", repr=False)  # the transfer's secret, drawn with its id
    pages: tuple[int, ...] = ()  # the cached (shared) pages first, then the own pages
    num_cached_tokens: int = 0  # positions [0, this) are the prefix-cache hit (page-aligned)
    deadline_s: float = 0.0  # `timeout_s` after the last sign of prefill's progress
    num_bytes_landed: int = 0  # of the transfer's KV, when the deadline last restarted
    release_reason: str | None = None  # set once releasing: waiting for the receiver's confirmation
    compiled_grammar: Any = None  # a structured-output request's grammar, compiled before the reservation
    cache_epoch: int = 0  # its tenant's when it was asked for: its namespace's (`KVCacheManager.cache_epoch`)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus the first output token, which decode's first step writes."""
        return len(self.prompt_token_ids) + 1


@dataclass(frozen=True)
class Released:
    """What the table keeps of a released reservation's transfer, for its late commit."""

    request_id: str
    tenant: str
    reason: str


class ReservationTable:
    def __init__(self, kv: KVCacheManager, receiver: KVReceiver, timeout_s: float) -> None:
        self.kv = kv
        self.receiver = receiver
        self.timeout_s = timeout_s
        self._by_transfer: dict[str, Reservation] = {}
        self._by_request: dict[str, Reservation] = {}
        self._waiting: deque[Reservation] = deque()
        self._released: RecentlyEnded[Released] = RecentlyEnded()
        self.num_expired = 0

    def __len__(self) -> int:
        return len(self._by_transfer)

    def request_ids(self) -> set[str]:
        """Requests whose pages the table holds (for the engine's integrity check)."""
        return {r.request_id for r in self._by_transfer.values()}

    def has_request(self, request_id: str) -> bool:
        return request_id in self._by_request

    def add(self, reservation: Reservation) -> None:
        """Queue a reservation; `place_waiting` gives it pages when there are enough."""
        self._by_request[reservation.request_id] = reservation
        self._waiting.append(reservation)

    def place_waiting(self, now_s: float | None = None) -> list[Reservation]:
        """Give pages to waiting reservations, oldest first, while they fit. Returns those placed."""
        placed = []
        while self._waiting and self.kv.can_reserve_on_prefix(_probe(self._waiting[0]), self._waiting[0].num_tokens):
            reservation = self._waiting.popleft()
            self._place(reservation, time.monotonic() if now_s is None else now_s)
            placed.append(reservation)
        return placed

    def _place(self, reservation: Reservation, now_s: float) -> None:
        r = reservation
        r.num_cached_tokens = self.kv.acquire_prefix(_probe(r))  # 0 with the cache off; the last token never hits
        # one run of consecutive pages where the pool has one: the transfer then moves a few large blocks
        self.kv.reserve(r.request_id, r.tenant, r.num_tokens,
                        namespace_of(r.tenant, r.params.cache_salt, r.cache_epoch), consecutive=True)
        r.transfer_id = secrets.token_hex(16)
        r.transfer_key = secrets.token_bytes(TRANSFER_KEY_BYTES)
        r.pages = tuple(self.kv.allocator.pages_of(r.request_id))
        r.deadline_s = now_s + self.timeout_s
        self.receiver.authorize(r.transfer_id, self.kv.allocator.own_pages_of(r.request_id), r.num_cached_tokens,
                                key=r.transfer_key)
        self._by_transfer[r.transfer_id] = r

    def by_transfer(self, transfer_id: str) -> Reservation | None:
        reservation = self._by_transfer.get(transfer_id)
        return reservation if reservation is not None and reservation.release_reason is None else None

    def released(self, transfer_id: str) -> Released | None:
        """The transfer of a reservation released here lately (not taken), or None: never
        reserved, taken by its commit, or released too long ago to remember."""
        return self._released.get(transfer_id)

    def by_request(self, request_id: str) -> Reservation | None:
        return self._by_request.get(request_id)

    def of_frontend(self, frontend: bytes) -> list[Reservation]:
        """The reservations `frontend` asked for, waiting or placed, not already releasing."""
        return [r for r in self._by_request.values() if r.frontend == frontend and r.release_reason is None]

    def take(self, reservation: Reservation) -> None:
        """The commit verified: the pages now belong to the running request. The receiver
        forgets the transfer (its last write landed before the commit)."""
        confirmed = self.receiver.cancel(reservation.transfer_id)
        assert confirmed, "a committed transfer has no write in flight"
        self._forget(reservation)

    def release(self, reservation: Reservation, reason: str) -> bool:
        """End the reservation; free its pages once no write can land. True if freed now."""
        if reservation in self._waiting:
            self._waiting.remove(reservation)
            self._forget(reservation)
            return True
        if reservation.release_reason is None:
            reservation.release_reason = reason
            self._released.add(reservation.transfer_id, Released(reservation.request_id, reservation.tenant, reason))
        if not self.receiver.cancel(reservation.transfer_id):
            return False
        self.kv.free(reservation.request_id)
        self._forget(reservation)
        return True

    def retry_releases(self) -> list[Reservation]:
        """Free the pages of releasing reservations whose transfers are now confirmed over."""
        releasing = [r for r in self._by_transfer.values() if r.release_reason is not None]
        return [r for r in releasing if self.release(r, r.release_reason or "")]

    def restart_deadline(self, reservation: Reservation, now_s: float | None = None) -> None:
        """A sign that prefill still works on the transfer: the reservation has `timeout_s` again."""
        reservation.deadline_s = (time.monotonic() if now_s is None else now_s) + self.timeout_s

    def expired(self, now_s: float | None = None) -> list[Reservation]:
        """Live reservations that heard nothing of their prefill for `timeout_s` (the caller
        releases them). One past its deadline that took in KV since its deadline last restarted
        has `timeout_s` again: asked at the deadline only (a NIXL receiver polls to answer), so
        the last block of a transfer that stops leaves it between one and two `timeout_s`."""
        now_s = time.monotonic() if now_s is None else now_s
        due = [r for r in self._by_transfer.values() if r.release_reason is None and r.deadline_s <= now_s]
        return [r for r in due if not self._landed_more(r, now_s)]

    def _landed_more(self, reservation: Reservation, now_s: float) -> bool:
        landed = self.receiver.landed(reservation.transfer_id)
        if landed is None or landed.num_bytes <= reservation.num_bytes_landed:
            return False
        reservation.num_bytes_landed = landed.num_bytes
        self.restart_deadline(reservation, now_s)
        return True

    def _forget(self, reservation: Reservation) -> None:
        self._by_transfer.pop(reservation.transfer_id, None)
        self._by_request.pop(reservation.request_id, None)


def _probe(reservation: Reservation) -> Request:
    """The reservation as the prefix cache sees a new request: its prompt in its namespace."""
    r = reservation
    return Request(r.request_id, r.tenant, r.prompt_token_ids, r.params, cache_epoch=r.cache_epoch)
