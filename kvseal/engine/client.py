"""The colocated engine backend (`kvseal.engine_api.EngineBackend`): the frontend's view of its
engine process. Submit, abort, route outputs, notice death, restart.

One receive task routes every engine message to its request's `RequestHandle`; one send
task owns the outgoing socket, so `submit` and `abort` never block or await (they are safe
to call from cleanup code running under cancellation). When the process ends for any
reason other than a requested shutdown, it is reaped, every in-flight request gets
`EngineGone` at once and new submissions raise `EngineUnavailable`: nothing waits on a dead
engine. It is then started again in the same private socket folder (`kvseal.engine.supervisor`:
backoff and a limit), with a fresh outgoing socket at a new address so nothing queued for the
dead engine reaches the new one; the frontend serves again once the new engine says it is ready.
A hung engine is noticed too: the process says it is alive every `HEARTBEAT_S` from a thread
(`kvseal.engine.process`), so one the frontend has not heard from for `--engine-timeout-s` is
stopped or frozen; it is logged at ERROR and killed by its PID (SIGKILL: a stopped process
cannot handle anything else), and its exit is then handled as a crash's, with the hang as why.

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
import time
from collections.abc import Callable
from typing import cast

import msgspec
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry, Counter

from kvseal.config import EngineArgs
from kvseal.engine.launcher import EngineProcess
from kvseal.engine.process import HEARTBEAT_S
from kvseal.engine.supervisor import RestartPolicy, RestartTracker, describe_exit, restarted
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
    EngineAliveMsg,
    EngineFailedMsg,
    EngineReadyMsg,
    EngineStatsMsg,
    EngineStoppedMsg,
    ForgetTenantMsg,
    FromEngineMsg,
    OutputsMsg,
    RequestOutputMsg,
    RequestRejectedMsg,
    ShutdownMsg,
    ToEngineMsg,
)
from kvseal.totals import CumulativeTotal

logger = logging.getLogger("kvseal.server")

_DRAIN_POLL_MS = 200  # after the process ends, collect what it sent just before


class EngineClient:
    def __init__(self, args: EngineArgs, log_level: str, restart: RestartPolicy | None = None) -> None:
        """`restart` None never restarts the engine (`RestartPolicy(engine_restart_limit=0)`)."""
        self._process = EngineProcess(args, log_level)
        self._restarts = RestartTracker(restart or RestartPolicy(engine_restart_limit=0))
        self._restarts_total: Counter | None = None
        self.on_stats: Callable[[EngineStatsMsg], None] | None = None
        # over engine processes (a restart starts its counts again from 0), as the PD frontend's
        self._pages_scrubbed, self._preemptions = CumulativeTotal(), CumulativeTotal()
        self.on_ready_change: Callable[[EngineReadyMsg], None] | None = None  # one engine: its limits never change
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._pull = self._ctx.socket(zmq.PULL)
        self._handles: dict[str, RequestHandle] = {}
        self._outbox: asyncio.Queue[ToEngineMsg] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._receive_task: asyncio.Task[None] | None = None
        self._send_task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self._last_heard_s = 0.0  # when the engine process last sent anything (monotonic)
        self._hung: str | None = None  # why the engine process was killed as hung, until its exit is handled
        self._ready: asyncio.Future[EngineReadyMsg] | None = None
        self._info: EngineReadyMsg | None = None  # the limits the frontend admits with
        self._engine_name = "engine"  # `engine-PID` of the process started last, for the audit
        self._exited = asyncio.Event()
        self._is_shutting_down = False
        self._down: str | None = None  # why the engine cannot serve now; cleared when a restart is ready
        self._exit_why = ""  # why the engine last exited, for what clients are told while it restarts
        self._broken: str | None = None  # the frontend's own routing failed: until the server restarts
        self._started_early = False  # the process runs, started by start_early; `start` takes it over

    @property
    def failure(self) -> str | None:
        return self._broken or self._down

    @property
    def engine_pids(self) -> str:
        return f"engine pid {self._process.pid}"

    @property
    def is_available(self) -> bool:
        ready = self._ready is not None and self._ready.done() and not self._ready.cancelled()
        return ready and self.failure is None and not self._is_shutting_down

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    def start_early(self) -> None:
        """Start the engine process now, before the frontend loads its own modules and runs its
        event loop: the engine's start-up (torch, the weights, the pool) then overlaps the
        frontend's on the other core. `start` takes the process over; `discard_early` stops it
        where the server stops before that."""
        self._started_early = True  # first: a SIGTERM while the process starts (its SystemExit) still discards it
        self._process.start()

    def discard_early(self) -> None:
        """Stop a process `start_early` started and `start` never took over (start-up failed)."""
        if self._started_early:
            self._started_early = False
            try:
                self._process.kill()
                self._process.join(timeout_s=10.0)
            finally:
                self._process.cleanup()

    async def start(self) -> EngineReadyMsg:
        """Spawn the engine and wait until it is ready; raise `EngineStartError` if it is not."""
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self._push.bind(self._process.addresses.to_engine)
        self._pull.bind(self._process.addresses.from_engine)
        self._spawn()
        self._info = await self._ready
        return self._info

    def _spawn(self) -> None:
        if self._started_early:  # it connects to the addresses bound in `start`
            self._started_early = False
        else:
            self._process.start()
        self._engine_name = f"engine-{self._process.pid}"
        self._restarts.started()
        asyncio.get_running_loop().add_reader(self._process.sentinel, self._on_process_exit)
        self._receive_task = asyncio.create_task(self._receive_loop())
        self._send_task = asyncio.create_task(self._send_loop())
        self._last_heard_s = time.monotonic()
        self._watch_task = asyncio.create_task(self._watch_liveness())
        self._tasks += [self._receive_task, self._send_task, self._watch_task]

    def submit(self, msg: AddRequestMsg, observer: RequestObserver) -> RequestHandle:
        if not self.is_available:
            raise EngineUnavailable(self.failure or "the server is shutting down")
        handle = RequestHandle(msg.request_id, msg.tenant, observer)
        handle.route["engine"] = self._engine_name  # the process serving it (audit)
        self._handles[msg.request_id] = handle
        self._outbox.put_nowait(msg)
        return handle

    def abort(self, request_id: str, tenant: str, reason: str) -> None:
        """Ask the engine to end the request; its terminal output arrives as usual."""
        if request_id in self._handles and self._down is None:
            self._outbox.put_nowait(AbortMsg(request_id, tenant, reason))

    def abort_all(self, reason: str) -> None:
        """Abort every in-flight request; each still ends with its own terminal output."""
        for handle in list(self._handles.values()):
            self.abort(handle.request_id, handle.tenant, reason)

    def forget_tenant(self, tenant: str) -> int:
        """Queued before anything submitted after it (one outbox, in order). An engine that is
        restarting gets it too, or has lost its cache with its process: either way none is left."""
        if self._is_shutting_down:
            return 0
        self._outbox.put_nowait(ForgetTenantMsg(tenant))
        return 1

    def add_metrics(self, registry: CollectorRegistry) -> None:
        """`kvseal_engine_restarts_total`; the server's own gauges say the rest about one engine."""
        self._restarts_total = Counter("kvseal_engine_restarts", "Engine processes restarted after they died",
                                       ["role"], registry=registry)
        self._restarts_total.labels(role="engine")

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort what is left in the engine, let it report, and wait for it to exit."""
        self._is_shutting_down = True
        try:
            if self._process.is_alive():
                if self._ready is not None and self._ready.done() and self._down is None:
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
        finally:  # however the stop ends (an exception, a cancel), the socket folder goes
            self._process.kill()
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
        self._broken = f"the frontend failed while routing engine outputs ({type(exc).__name__})"
        self._fail(self._broken)

    async def _send_loop(self) -> None:
        while True:
            msg = await self._outbox.get()
            await self._push.send(encode(msg))

    async def _watch_liveness(self) -> None:
        """Kill an engine process silent for `--engine-timeout-s` (it exits, and `_after_exit`
        fails its requests and restarts it). Messages waiting unread mean this loop was the slow one."""
        timeout_s = self._restarts.policy.engine_timeout_s
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            silent_s = time.monotonic() - self._last_heard_s
            if silent_s > timeout_s and not self._has_unread():
                self._kill_hung(silent_s, timeout_s)
                return

    def _has_unread(self) -> bool:
        return bool(cast(int, self._pull.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def _kill_hung(self, silent_s: float, timeout_s: float) -> None:
        self._hung = (f"the engine process stopped responding (silent for {silent_s:.0f} s, --engine-timeout-s "
                      f"{timeout_s:g}) and was killed")
        logger.error("the engine process (pid %s) has sent nothing for %.1f s, not even its heartbeat: it is hung "
                     "(stopped or frozen); killing it with SIGKILL and failing its %d in-flight requests",
                     self._process.pid, silent_s, len(self._handles))
        self._process.kill()

    def _receive(self, data: bytes) -> None:
        self._last_heard_s = time.monotonic()
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
                    self.on_stats(self._totalled(msg))
            case EngineReadyMsg():
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(msg)
            case EngineFailedMsg():
                # clients get the engine's plain reason; the log and a start-up error also its type
                self._fail(msg.message, f"{msg.error_type}: {msg.message}")
            case EngineStoppedMsg():
                logger.info("engine stopped; %d requests were aborted", msg.num_aborted)
            case EngineAliveMsg():
                pass  # heard: `_receive` noted when

    def _totalled(self, stats: EngineStatsMsg) -> EngineStatsMsg:
        """The engine's stats with its cumulative counts taken over every engine process this
        client started: a restarted engine counts from 0 again, and a counter built on its count
        alone would lose what the dead one had counted whenever the new one caught up."""
        instance = str(self._process.num_starts)  # (each start is a new process)
        self._pages_scrubbed.observe(instance, stats.num_pages_scrubbed)
        self._preemptions.observe(instance, stats.num_preemptions)
        return msgspec.structs.replace(stats, num_pages_scrubbed=self._pages_scrubbed.total,
                                       num_preemptions_total=self._preemptions.total)

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

    def _fail(self, message: str, detail: str | None = None) -> None:
        """The engine is unavailable: `message` is what clients and /health are told, `detail`
        (the engine's exception type with it) what the log and a start-up error say."""
        detail = detail or message
        if self._down is None:
            self._down = message
            if not self._is_shutting_down:
                logger.error("engine unavailable: %s; failing %d in-flight requests", detail, len(self._handles))
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineStartError(detail))
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
        assert self._receive_task is not None and self._send_task is not None and self._watch_task is not None
        self._receive_task.cancel()  # drain below instead, then stop
        self._send_task.cancel()  # what it still holds was for the dead engine
        self._watch_task.cancel()
        await self._drain()
        self._process.join()  # reaped: no <defunct> child
        code = self._process.exitcode
        why, self._hung = self._hung or f"the engine process exited unexpectedly ({describe_exit(code)})", None
        if self._is_shutting_down:
            if code != 0:
                self._fail(why)
            self._exited.set()
            return
        delay_s = self._failed_by_exit(why)
        self._exited.set()
        if delay_s is not None:
            await asyncio.sleep(delay_s)
            if not self._is_shutting_down:
                await self._restart()

    def _failed_by_exit(self, why: str) -> float | None:
        """Fail what the dead engine held and say why; the wait before its restart, or None when
        it stays down (past the limit, or it died before it was ever ready: a start-up error)."""
        delay_s = self._restarts.next_delay_s() if self._info is not None else None
        policy = self._restarts.policy
        if delay_s is None:
            gave_up = self._info is not None  # else a start-up error, failed as it is
            self._fail(f"{why}; it was {self._restarts.gave_up()}" if gave_up else why)
            if gave_up:
                logger.critical("engine unavailable until the server is restarted: %s", self._down)
            return None
        self._down = None  # replaced by why, whatever the engine said before it died
        self._exit_why = why
        self._fail(f"{why}; restarting it in {delay_s:g} s (restart {self._restarts.num_in_a_row} in a row, at most "
                   f"{policy.engine_restart_limit})")
        return delay_s

    async def _restart(self) -> None:
        """Start a new engine process; serve again once it is ready (if it dies first, its exit is
        handled as any other)."""
        self._reset_outgoing()
        self._ready = asyncio.get_running_loop().create_future()
        self._exited = asyncio.Event()
        self._spawn()
        if self._restarts_total is not None:
            self._restarts_total.labels(role="engine").inc()
        logger.warning("restarting the engine (pid %s): %s", self._process.pid, self._down)
        self._down = restarted(self._exit_why)  # it is no longer "restarting it in N s"
        try:
            info = await self._ready
        except EngineStartError:
            return  # logged by `_fail`; the process exits and `_after_exit` decides again
        if self._is_shutting_down or self._broken is not None:
            return
        self._down = None
        logger.warning("the engine restarted (pid %s) and is serving again", info.pid)
        if self._info is not None and (info.max_model_len, info.kv_cache_tokens) != (
                self._info.max_model_len, self._info.kv_cache_tokens) and self.on_ready_change is not None:
            self.on_ready_change(info)
        self._info = info

    def _reset_outgoing(self) -> None:
        """A new PUSH socket at a new address and an empty outbox: nothing queued for the dead
        engine reaches its successor."""
        self._push.close(linger=0)
        while not self._outbox.empty():
            self._outbox.get_nowait()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.bind(self._process.new_inbox())

    async def _drain(self) -> None:
        while await self._pull.poll(timeout=_DRAIN_POLL_MS):
            self._receive(await self._pull.recv())
