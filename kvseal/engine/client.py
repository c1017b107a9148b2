"""The colocated engine backend (`kvseal.engine_api.EngineBackend`): the frontend's view of its
engine process. Submit, abort, route outputs, notice death.

One receive task routes every engine message to its request's `RequestHandle`; one send
task owns the outgoing socket, so `submit` and `abort` never block or await (they are safe
to call from cleanup code running under cancellation). When the process ends for any
reason other than a requested shutdown, every in-flight request gets `EngineGone` at once
and new submissions raise `EngineUnavailable`: nothing waits on a dead engine.

The receive loop fails closed. Every output names its tenant; one that does not match its
request's tenant ends that request with `IsolationBreach` (and is aborted in the engine),
never reaching the client. Auditing never raises here (`AuditLog.write` reports a line it
could not write, and the call withholds that answer). Any exception while routing, auditing
or counting is a frontend bug that could leave requests waiting forever: it is logged at CRITICAL, every in-flight
request is aborted in the engine and fails with an error, and the client stays unavailable
(/health 503) until restarted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from kvseal.config import EngineArgs
from kvseal.engine.launcher import EngineProcess
from kvseal.engine_api import (
    EngineGone,
    EngineStartError,
    EngineUnavailable,
    IsolationBreach,
    RequestHandle,
    RequestObserver,
    is_terminal,
)
from kvseal.messages.codec import decode_from_engine, encode
from kvseal.messages.msgs import (
    ABORT_SERVER_SHUTDOWN,
    AbortMsg,
    AddRequestMsg,
    EngineFailedMsg,
    EngineReadyMsg,
    EngineStatsMsg,
    EngineStoppedMsg,
    FromEngineMsg,
    OutputsMsg,
    RequestOutputMsg,
    RequestRejectedMsg,
    ShutdownMsg,
    ToEngineMsg,
)

logger = logging.getLogger("kvseal.server")

_DRAIN_POLL_MS = 200  # after the process ends, collect what it sent just before


class EngineClient:
    def __init__(self, args: EngineArgs, log_level: str) -> None:
        self._process = EngineProcess(args, log_level)
        self.on_stats: Callable[[EngineStatsMsg], None] | None = None
        self.on_ready_change: Callable[[EngineReadyMsg], None] | None = None  # one engine: its limits never change
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._pull = self._ctx.socket(zmq.PULL)
        self._handles: dict[str, RequestHandle] = {}
        self._outbox: asyncio.Queue[ToEngineMsg] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._ready: asyncio.Future[EngineReadyMsg] | None = None
        self._exited = asyncio.Event()
        self._is_shutting_down = False
        self.failure: str | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def is_available(self) -> bool:
        ready = self._ready is not None and self._ready.done() and not self._ready.cancelled()
        return ready and self.failure is None and not self._is_shutting_down

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    async def start(self) -> EngineReadyMsg:
        """Spawn the engine and wait until it is ready; raise `EngineStartError` if it is not."""
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._push.bind(self._process.addresses.to_engine)
        self._pull.bind(self._process.addresses.from_engine)
        self._process.start()
        loop.add_reader(self._process.sentinel, self._on_process_exit)
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._send_loop())]
        return await self._ready

    def submit(self, msg: AddRequestMsg, observer: RequestObserver) -> RequestHandle:
        if not self.is_available:
            raise EngineUnavailable(self.failure or "the server is shutting down")
        handle = RequestHandle(msg.request_id, msg.tenant, observer)
        self._handles[msg.request_id] = handle
        self._outbox.put_nowait(msg)
        return handle

    def abort(self, request_id: str, tenant: str, reason: str) -> None:
        """Ask the engine to end the request; its terminal output arrives as usual."""
        if request_id in self._handles and self.failure is None:
            self._outbox.put_nowait(AbortMsg(request_id, tenant, reason))

    def abort_all(self, reason: str) -> None:
        """Abort every in-flight request; each still ends with its own terminal output."""
        for handle in list(self._handles.values()):
            self.abort(handle.request_id, handle.tenant, reason)

    def add_metrics(self, registry: CollectorRegistry) -> None:
        pass  # the server's own gauges say all there is about one engine

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort what is left in the engine, let it report, and wait for it to exit."""
        self._is_shutting_down = True
        if self._process.is_alive():
            if self._ready is not None and self._ready.done() and self.failure is None:
                self._outbox.put_nowait(ShutdownMsg(ABORT_SERVER_SHUTDOWN))
                await self._wait_exit(timeout_s)
            self._process.kill()
            await self._wait_exit(timeout_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_handles("the server is shutting down")
        self._push.close(linger=0)
        self._pull.close(linger=0)
        self._ctx.term()
        self._process.join()
        self._process.cleanup()

    async def _wait_exit(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self._exited.wait(), timeout_s)
        except TimeoutError:
            logger.error("the engine process did not exit within %.0f s; killing it", timeout_s)

    async def _receive_loop(self) -> None:
        while True:
            data = await self._pull.recv()
            try:
                self._receive(data)
            except Exception as exc:
                self._receive_failed(exc)
                return

    def _receive_failed(self, exc: Exception) -> None:
        """Fail closed: nothing may wait on outputs this loop will never route."""
        logger.critical("the frontend's engine receive loop failed; aborting and failing every in-flight "
                        "request and refusing new ones until the server is restarted", exc_info=exc)
        self.abort_all(ABORT_SERVER_SHUTDOWN)
        self._fail(f"the frontend failed while routing engine outputs ({type(exc).__name__})")

    async def _send_loop(self) -> None:
        while True:
            msg = await self._outbox.get()
            await self._push.send(encode(msg))

    def _receive(self, data: bytes) -> None:
        try:
            msg = decode_from_engine(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.error("dropping an undecodable engine message: %s", exc)
            return
        self._on_msg(msg)

    def _on_msg(self, msg: FromEngineMsg) -> None:
        match msg:
            case OutputsMsg():
                for out in msg.outputs:
                    self._route(out)
            case RequestRejectedMsg():
                self._route(msg)
            case EngineStatsMsg():
                if self.on_stats is not None:
                    self.on_stats(msg)
            case EngineReadyMsg():
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(msg)
            case EngineFailedMsg():
                self._fail(f"{msg.error_type}: {msg.message}")
            case EngineStoppedMsg():
                logger.info("engine stopped; %d requests were aborted", msg.num_aborted)

    def _route(self, event: RequestOutputMsg | RequestRejectedMsg) -> None:
        handle = self._handles.get(event.request_id)
        if handle is None:
            logger.warning("engine reported request %s, which has no handle", event.request_id)
            return
        if event.tenant != handle.tenant:
            self._tenant_mismatch(handle, event.tenant)
            return
        if is_terminal(event):
            del self._handles[event.request_id]
        handle.deliver(event)

    def _tenant_mismatch(self, handle: RequestHandle, reported: str) -> None:
        """An output for this request id names another tenant: drop it, end the request, fail closed."""
        message = (f"frontend tenant check: the engine reported tenant '{reported[:64]}' for request "
                   f"{handle.request_id} of tenant '{handle.tenant}'")
        self.abort(handle.request_id, handle.tenant, "isolation_check_failed")
        del self._handles[handle.request_id]
        handle.deliver(IsolationBreach(message))

    def _fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message
            if not self._is_shutting_down:
                logger.error("engine unavailable: %s; failing %d in-flight requests", message, len(self._handles))
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineStartError(message))
        self._fail_handles(message)

    def _fail_handles(self, message: str) -> None:
        """Every handle gets its terminal event, even if delivering one of them raises."""
        handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            try:
                handle.deliver(EngineGone(message))
            except Exception:
                logger.exception("failing request %s raised; it was failed anyway", handle.request_id)

    def _on_process_exit(self) -> None:
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        self._tasks.append(asyncio.create_task(self._after_exit()))

    async def _after_exit(self) -> None:
        self._tasks[0].cancel()  # the receive loop: drain below instead, then stop
        await self._drain()
        self._process.join()
        code = self._process.exitcode
        if not (self._is_shutting_down and code == 0):
            self._fail(f"the engine process exited unexpectedly (exit code {code})")
        self._exited.set()

    async def _drain(self) -> None:
        while await self._pull.poll(timeout=_DRAIN_POLL_MS):
            self._receive(await self._pull.recv())
