"""Requests waiting for their grammar, held by an engine loop (colocated, prefill or decode)
until the compile pool has it: nothing of them exists in the scheduler or the KV cache yet.

Every way out is explicit: `take_ready` (compiled or refused: the caller goes on or answers
the refusal), `cancel` (the request's own tenant aborted it: its compile is cancelled),
`cancel_matching` (a PD engine's frontend is gone) and `cancel_all` (shutdown). A cancelled
wait releases its ticket, so a compile nobody waits for any more is stopped
(`GrammarTicket.cancel`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvseal.structured.compiler import GrammarTicket

T = TypeVar("T")


@dataclass(frozen=True)
class Waiting(Generic[T]):
    tenant: str
    ticket: GrammarTicket
    item: T  # what the loop runs once the grammar is there (its message, parameters, ...)


class PendingGrammars(Generic[T]):
    def __init__(self) -> None:
        self._by_request: dict[str, Waiting[T]] = {}

    def __len__(self) -> int:
        return len(self._by_request)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_request

    def add(self, request_id: str, tenant: str, ticket: GrammarTicket, item: T) -> None:
        assert request_id not in self._by_request, "a request waits for one grammar"
        self._by_request[request_id] = Waiting(tenant, ticket, item)

    def items(self) -> list[T]:
        """What every wait will run, in arrival order (the table is unchanged)."""
        return [waiting.item for waiting in self._by_request.values()]

    def take_ready(self) -> list[Waiting[T]]:
        """The waits whose compile has ended (compiled or refused: `ticket.result()` says), in
        arrival order; they leave the table."""
        ready = [rid for rid, waiting in self._by_request.items() if waiting.ticket.done()]
        return [self._by_request.pop(rid) for rid in ready]

    def cancel(self, request_id: str, tenant: str) -> T | None:
        """End the wait of `request_id` if `tenant` owns it; its item, or None."""
        waiting = self._by_request.get(request_id)
        if waiting is None or waiting.tenant != tenant:
            return None
        del self._by_request[request_id]
        waiting.ticket.cancel()
        return waiting.item

    def cancel_all(self) -> list[tuple[str, T]]:
        """End every wait (shutdown); (request id, item) of each."""
        return self.cancel_matching(lambda item: True)

    def cancel_matching(self, matches: Callable[[T], bool]) -> list[tuple[str, T]]:
        """End the waits whose item `matches` (all those of a frontend that is gone); (request id, item) of each."""
        ended = [request_id for request_id, waiting in self._by_request.items() if matches(waiting.item)]
        waits = [(request_id, self._by_request.pop(request_id)) for request_id in ended]
        for _, waiting in waits:
            waiting.ticket.cancel()
        return [(request_id, waiting.item) for request_id, waiting in waits]
