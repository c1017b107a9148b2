"""The frontend's end of one engine request: an event queue plus its observer.

Events arrive in engine order. Exactly one of them is terminal: a finished
`RequestOutputMsg` (done or aborted), a `RequestRejectedMsg`, `EngineGone` when the
engine process died or stopped first, or `IsolationBreach` when the frontend itself
caught an isolation failure (an output carrying another tenant's name). The observer
sees every event as it is routed (so the audit record and the tenant slot do not wait for
the HTTP side to read them); the consumer reads them from `events()`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from kvseal.messages.msgs import RequestOutputMsg, RequestRejectedMsg
from kvseal.types import ISOLATION_CHECK_FAILED

# The engine's abort text in checked mode before it set `error_code` (kept so both are recognised).
_ISOLATION_ERROR_PREFIX = "isolation check failed"


@dataclass(frozen=True)
class EngineGone:
    """The engine ended before it reported this request (it died, failed or stopped)."""

    message: str


@dataclass(frozen=True)
class IsolationBreach:
    """The frontend failed the request closed: something it received breaks isolation."""

    message: str


RequestEvent = RequestOutputMsg | RequestRejectedMsg | EngineGone | IsolationBreach


def isolation_failure(event: RequestEvent) -> str | None:
    """The reason, when `event` ends its request because an isolation check tripped."""
    if isinstance(event, IsolationBreach):
        return event.message
    if not isinstance(event, RequestOutputMsg) or event.finish_reason != "abort":
        return None
    if event.error_code == ISOLATION_CHECK_FAILED or (event.error or "").startswith(_ISOLATION_ERROR_PREFIX):
        return event.error or ISOLATION_CHECK_FAILED
    return None


def is_terminal(event: RequestEvent) -> bool:
    return not isinstance(event, RequestOutputMsg) or event.finished


class RequestObserver(Protocol):
    def on_output(self, out: RequestOutputMsg) -> None: ...

    def on_terminal(self, event: RequestEvent) -> None: ...


class RequestHandle:
    def __init__(self, request_id: str, tenant: str, observer: RequestObserver) -> None:
        self.request_id = request_id
        self.tenant = tenant
        self._observer = observer
        self._queue: asyncio.Queue[RequestEvent] = asyncio.Queue()
        self.is_terminal = False
        self.route: dict[str, str] = {}  # PD mode: prefill_engine, decode_engine, transfer_id (audit)

    def deliver(self, event: RequestEvent) -> None:
        assert not self.is_terminal, f"event for request {self.request_id} after its terminal event"
        self._queue.put_nowait(event)  # first: the consumer gets it even if the observer raises
        if is_terminal(event):
            self.is_terminal = True
        if isinstance(event, RequestOutputMsg):
            self._observer.on_output(event)
        if is_terminal(event):
            self._observer.on_terminal(event)

    async def events(self) -> AsyncIterator[RequestEvent]:
        """Every event up to and including the terminal one."""
        while True:
            event = await self._queue.get()
            yield event
            if is_terminal(event):
                return
