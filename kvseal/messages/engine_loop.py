"""The engine process's loop: receive messages, step the engine, send what it produced.

Contract: every `AddRequestMsg` ends in exactly one terminal report for its request id,
either a `RequestRejectedMsg` (the engine's admission re-check, I1, refused it; nothing was
queued) or a finished `RequestOutputMsg` (done, or aborted with the reason in `error`). A
rejected request is never turned into a crash: `RequestRejected` is a value here. Any other
exception is an engine bug; it propagates and the process reports it and exits.
"""

from __future__ import annotations

import logging

import zmq

from kvseal.engine.engine import LLMEngine
from kvseal.errors import RequestRejected
from kvseal.messages.codec import decode_to_engine, encode
from kvseal.messages.convert import output_to_msg, params_from_msg
from kvseal.messages.msgs import (
    AbortMsg,
    AddRequestMsg,
    EngineStatsMsg,
    EngineStoppedMsg,
    FromEngineMsg,
    OutputsMsg,
    RequestOutputMsg,
    RequestRejectedMsg,
    ShutdownMsg,
    ToEngineMsg,
)

logger = logging.getLogger("kvseal.engine")

IDLE_POLL_MS = 1000  # how long an idle loop sleeps in poll before re-checking its parent


class EngineLoop:
    def __init__(self, engine: LLMEngine, inbox: zmq.Socket, outbox: zmq.Socket, parent_fd: int | None = None) -> None:
        self.engine = engine
        self._inbox = inbox
        self._outbox = outbox
        self._parent_fd = parent_fd
        self._poller = zmq.Poller()
        self._poller.register(inbox, zmq.POLLIN)
        if parent_fd is not None:
            self._poller.register(parent_fd, zmq.POLLIN)
        self.is_stopped = False

    def run(self) -> None:
        while self.run_once():
            pass

    def run_once(self, idle_poll_ms: int = IDLE_POLL_MS) -> bool:
        """One iteration. Returns False once the loop has stopped (shutdown or parent gone)."""
        events = dict(self._poller.poll(0 if self.engine.has_unfinished() else idle_poll_ms))
        if self._parent_fd is not None and self._parent_fd in events:
            logger.error("the frontend process is gone; aborting every request and exiting")
            self._shutdown("frontend process exited")
            return False
        changed = self._drain_inbox()
        if self.is_stopped:
            return False
        if self.engine.has_unfinished():
            self._step()
            changed = True
        if changed:
            self._send(self._stats())
        return True

    def _drain_inbox(self) -> bool:
        changed = False
        while not self.is_stopped:
            try:
                data = self._inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return changed
            self.handle(decode_to_engine(data))
            changed = True
        return changed

    def handle(self, msg: ToEngineMsg) -> None:
        match msg:
            case AddRequestMsg():
                self._add(msg)
            case AbortMsg():
                self._abort(msg)
            case ShutdownMsg():
                self._shutdown(msg.reason)

    def _add(self, msg: AddRequestMsg) -> None:
        try:
            params = params_from_msg(msg.params)
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, params, msg.tenant)
        except RequestRejected as exc:
            logger.warning("engine re-check rejected request %s: %s", msg.request_id, exc.message)
            self._send(RequestRejectedMsg(msg.request_id, msg.tenant, exc.code, exc.message, exc.param,
                                          exc.http_status))

    def _abort(self, msg: AbortMsg) -> None:
        request = self.engine.find(msg.request_id)
        if request is None or request.tenant != msg.tenant:
            return  # already finished (its final output is on its way) or not this tenant's
        self._send(OutputsMsg([self._abort_one(msg.request_id, msg.reason)]))

    def _abort_one(self, request_id: str, reason: str) -> RequestOutputMsg:
        out = self.engine.abort(request_id, reason)
        assert out is not None, "abort of a request the scheduler holds reports it"
        return output_to_msg(out)

    def _shutdown(self, reason: str) -> None:
        live = self.engine.unfinished_ids()
        if live:
            self._send(OutputsMsg([self._abort_one(request_id, reason) for request_id in live]))
        self._send(EngineStoppedMsg(len(live)))
        self.is_stopped = True

    def _step(self) -> None:
        msgs = [output_to_msg(o) for o in self.engine.step()]
        if msgs:
            self._send(OutputsMsg(msgs))

    def _stats(self) -> EngineStatsMsg:
        s = self.engine.stats()
        return EngineStatsMsg(s.num_running, s.num_waiting, s.num_pages_used, s.num_pages_free, s.num_preemptions,
                              s.num_isolation_violations)

    def _send(self, msg: FromEngineMsg) -> None:
        self._outbox.send(encode(msg))
