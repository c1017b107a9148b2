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
from kvseal.errors import InvalidParameter, RequestRejected
from kvseal.messages.codec import decode_to_engine, encode
from kvseal.messages.convert import output_to_msg, params_from_msg, stats_to_msg
from kvseal.messages.msgs import (
    AbortMsg,
    AddRequestMsg,
    EngineStoppedMsg,
    FromEngineMsg,
    OutputsMsg,
    RequestOutputMsg,
    RequestRejectedMsg,
    ShutdownMsg,
    ToEngineMsg,
)
from kvseal.structured.compiler import GrammarPoolStats
from kvseal.structured.pending import PendingGrammars
from kvseal.types import SamplingParams

logger = logging.getLogger("kvseal.engine")

IDLE_POLL_MS = 1000  # how long an idle loop sleeps in poll before re-checking its parent
GRAMMAR_POLL_MS = 5  # how often a loop with only grammars compiling checks on them


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
        # structured-output requests whose grammar is compiling (not yet in the engine)
        self._compiling: PendingGrammars[tuple[AddRequestMsg, SamplingParams]] = PendingGrammars()
        self._grammar_stats_sent = GrammarPoolStats()

    def run(self) -> None:
        while self.run_once():
            pass

    def run_once(self, idle_poll_ms: int = IDLE_POLL_MS) -> bool:
        """One iteration. Returns False once the loop has stopped (shutdown or parent gone)."""
        events = dict(self._poller.poll(self._poll_ms(idle_poll_ms)))
        if self._parent_fd is not None and self._parent_fd in events:
            logger.error("the frontend process is gone; aborting every request and exiting")
            self._shutdown("frontend process exited")
            return False
        changed = self._drain_inbox()
        if self.is_stopped:
            return False
        changed |= self._add_compiled()
        if self.engine.has_unfinished():
            self._step()
            changed = True
        if changed or self._grammar_stats_changed():
            self._send_stats()
        return True

    def _grammar_stats_changed(self) -> bool:
        """The compile pool changes on its own threads (a worker ready, a compile stopped)."""
        return self.engine.grammar_stats() != self._grammar_stats_sent

    def _send_stats(self) -> None:
        stats = self.engine.stats()
        self._grammar_stats_sent = stats.grammar
        self._send(stats_to_msg(stats))

    def _poll_ms(self, idle_poll_ms: int) -> int:
        if self.engine.has_unfinished():
            return 0
        return GRAMMAR_POLL_MS if self._compiling else idle_poll_ms

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
            if params.structured is not None:  # compiled off the loop; added once it is ready
                if msg.request_id in self._compiling:
                    raise InvalidParameter(f"request id {msg.request_id!r} is already in use", param="request_id")
                ticket = self.engine.grammars.compile(msg.tenant, params.structured)
                self._compiling.add(msg.request_id, msg.tenant, ticket, (msg, params))
                return
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, params, msg.tenant,
                                        cache_namespace=msg.cache_namespace)
        except RequestRejected as exc:
            self._reject(msg, exc)

    def _add_compiled(self) -> bool:
        ready = self._compiling.take_ready()
        for waiting in ready:
            msg, params = waiting.item
            try:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, params, msg.tenant,
                                        compiled_grammar=waiting.ticket.result(),
                                        cache_namespace=msg.cache_namespace)
            except RequestRejected as exc:
                self._reject(msg, exc)
        return bool(ready)

    def _reject(self, msg: AddRequestMsg, exc: RequestRejected) -> None:
        logger.warning("engine re-check rejected request %s: %s", msg.request_id, exc.message)
        self._send(RequestRejectedMsg(msg.request_id, msg.tenant, exc.code, exc.message, exc.param, exc.http_status))

    def _abort(self, msg: AbortMsg) -> None:
        compiling = self._compiling.cancel(msg.request_id, msg.tenant)  # its compile is cancelled too
        if compiling is not None:
            self._send(OutputsMsg([_compile_aborted(compiling[0], msg.reason)]))
            return
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
        outputs = [self._abort_one(request_id, reason) for request_id in live]
        outputs += [_compile_aborted(msg, reason) for _, (msg, _) in self._compiling.cancel_all()]
        if outputs:
            self._send(OutputsMsg(outputs))
        self._send(EngineStoppedMsg(len(outputs)))
        self.is_stopped = True

    def _step(self) -> None:
        msgs = [output_to_msg(o) for o in self.engine.step()]
        if msgs:
            self._send(OutputsMsg(msgs))

    def _send(self, msg: FromEngineMsg) -> None:
        self._outbox.send(encode(msg))


def _compile_aborted(msg: AddRequestMsg, reason: str) -> RequestOutputMsg:
    """The end of a request still waiting for its grammar: it never reached the engine."""
    return RequestOutputMsg(msg.request_id, msg.tenant, [], "", True, "abort", None, len(msg.prompt_token_ids), 0, 0,
                            error=reason)
