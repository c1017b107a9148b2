"""What the HTTP layer needs from an engine backend, and nothing else.

`EngineBackend` is the interface: the colocated engine client (`kvseal.engine.client`) and the
PD client (`kvseal.disagg.frontend`) implement it; the HTTP layer (`kvseal.server`) uses it and
imports neither; the command line picks one and hands it to the server. `RequestHandle` is
the frontend's end of one engine request, which both backends hand out.

Events of one request arrive in engine order. Exactly one of them is terminal: a finished
`RequestOutputMsg` (done or aborted), a `RequestRejectedMsg`, `EngineGone` when the
engine process died or stopped first, or `IsolationBreach` when the frontend itself
caught an isolation failure (an output carrying another tenant's name). The observer
sees every event as it is routed (so the audit record and the tenant slot do not wait for
the HTTP side to read them); the consumer reads them from `events()`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry

from kvseal.errors import KvsealError
from kvseal.messages.msgs import AddRequestMsg, EngineReadyMsg, EngineStatsMsg, RequestOutputMsg, RequestRejectedMsg
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
        # the engines that handled it, for the audit: colocated `engine`; PD prefill_engine, decode_engine, transfer_id
        self.route: dict[str, str] = {}

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


class EngineStartError(KvsealError):
    """The engine could not load the model or refused the configuration."""


# The end of what clients are told of an engine that stays down (past `--engine-restart-limit`):
# retrying cannot help, so the 503 does not say "Retry later".
RESTART_THE_SERVER = "restart the server"


class EngineUnavailable(KvsealError):
    """No engine can take the request: gone, failed, unreachable, or the server is shutting down
    (the HTTP layer answers 503)."""


class EngineBackend(Protocol):
    """The engines behind one HTTP frontend, as the frontend sees them.

    Every submitted request ends exactly once on its handle (a finished output, a rejection,
    `EngineGone` or `IsolationBreach`); no method waits on an engine except `start` and
    `shutdown`. `submit`, `abort` and `abort_all` never block or await, so cleanup code running
    under cancellation may call them.
    """

    # Told the engines' load (summed over the engines that are up) after every change.
    on_stats: Callable[[EngineStatsMsg], None] | None
    # Told the new limits when an engine (re)starts with different ones; the front door admits
    # with them (I1).
    on_ready_change: Callable[[EngineReadyMsg], None] | None

    @property
    def engine_pids(self) -> str:
        """The engine processes' ids, each named by its role, for the logs: "engine pid N", or in
        PD "prefill engine pid P, decode engine pid D"."""
        ...

    @property
    def is_available(self) -> bool:
        """Whether `submit` may succeed now (/health)."""
        ...

    @property
    def failure(self) -> str | None:
        """Why the backend cannot take requests, or None."""
        ...

    @property
    def num_in_flight(self) -> int:
        """Requests submitted and not yet ended."""
        ...

    async def start(self) -> EngineReadyMsg:
        """Wait until the engines are ready; their limits (the smallest, with several engines) and
        tokenizer. Raises `EngineStartError` (or `ConfigError`) when they cannot start."""
        ...

    def submit(self, msg: AddRequestMsg, observer: RequestObserver) -> RequestHandle:
        """Send an admitted request (I1 passed at the door); raises `EngineUnavailable`."""
        ...

    def abort(self, request_id: str, tenant: str, reason: str) -> None:
        """Ask the engines to end the request if `tenant` owns it; its terminal event follows."""
        ...

    def abort_all(self, reason: str) -> None:
        """Abort every request in flight; each still ends with its own terminal event."""
        ...

    def forget_tenant(self, tenant: str) -> int:
        """Have every engine forget `tenant`'s prefix cache (`ForgetTenantMsg`) before any request
        submitted after this call reaches it; the tenant's requests submitted before are closed to
        the cache. Never blocks. Returns the engines told now (an engine that is down is told when
        it answers again, or starts with an empty cache)."""
        ...

    def add_metrics(self, registry: CollectorRegistry) -> None:
        """Register the backend's own gauges (PD: per-engine handoff figures) on /metrics."""
        ...

    async def shutdown(self) -> None:
        """Abort what is left, stop the engines this backend started, close every link."""
        ...
