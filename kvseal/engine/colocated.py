"""The colocated engine's part of the loop: its link to the one frontend, and its steps.

Contract: every `AddRequestMsg` ends in exactly one terminal report for its request id,
either a `RequestRejectedMsg` (the engine's admission re-check, I1, refused it; nothing was
queued) or a finished `RequestOutputMsg` (done, or aborted with the reason in `error`). A
rejected request is never turned into a crash: `RequestRejected` is a value here. Any other
exception is an engine bug; it propagates and the process reports it and exits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from kvseal.engine.engine import LLMEngine
from kvseal.engine.loop import EngineLoop
from kvseal.errors import InvalidParameter, RequestRejected
from kvseal.messages.codec import decode_to_engine, encode
from kvseal.messages.convert import output_to_msg, params_from_msg, stats_to_msg
from kvseal.messages.msgs import (
    AbortMsg,
    AddRequestMsg,
    EngineStoppedMsg,
    ForgetTenantMsg,
    FromEngineMsg,
    OutputsMsg,
    RequestOutputMsg,
    RequestRejectedMsg,
    ShutdownMsg,
    ToEngineMsg,
)
from kvseal.structured.pending import PendingGrammars
from kvseal.types import RequestOutput, SamplingParams

logger = logging.getLogger("kvseal.engine")

IDLE_POLL_MS = 1000  # how long an idle loop sleeps in poll before re-checking its parent
GRAMMAR_POLL_MS = 5  # how often a loop with only grammars compiling checks on them


class ColocatedSteps:
    """Add, abort and shut down on the frontend's word; structured requests wait for their
    grammar off the loop and join the engine once it compiled."""

    def __init__(self, engine: LLMEngine, send: Callable[[FromEngineMsg], None]) -> None:
        self.engine = engine
        self._send = send
        self.is_stopped = False
        # structured-output requests whose grammar is compiling (not yet in the engine), with the
        # cache epoch they arrived in (`LLMEngine.arrival_epoch`)
        self._compiling: PendingGrammars[tuple[AddRequestMsg, SamplingParams, int]] = PendingGrammars()

    def handle(self, msg: ToEngineMsg) -> None:
        match msg:
            case AddRequestMsg():
                self._add(msg)
            case AbortMsg():
                self._abort(msg)
            case ForgetTenantMsg():
                self.engine.forget_tenant(msg.tenant, msg.request_ids)
            case ShutdownMsg():
                self.shutdown(msg.reason)

    def poll_ms(self, idle_poll_ms: int) -> int:
        return GRAMMAR_POLL_MS if self._compiling else idle_poll_ms

    def tick(self) -> bool:
        self.engine.check_ranks()  # a tensor-parallel rank lost while idle fails the engine now
        ready = self._compiling.take_ready()
        for waiting in ready:
            msg, params, cache_epoch = waiting.item
            try:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, params, msg.tenant,
                                        compiled_grammar=waiting.ticket.result(), cache_epoch=cache_epoch)
            except RequestRejected as exc:
                self._reject(msg, exc)
        return bool(ready)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._send(OutputsMsg([output_to_msg(o) for o in outputs]))

    def _add(self, msg: AddRequestMsg) -> None:
        try:
            params = params_from_msg(msg.params)
            if params.structured is not None:  # compiled off the loop; added once it is ready
                if msg.request_id in self._compiling:
                    raise InvalidParameter(f"request id {msg.request_id!r} is already in use", param="request_id")
                ticket = self.engine.grammars.compile(msg.tenant, params.structured)
                cache_epoch = self.engine.arrival_epoch(msg.request_id, msg.tenant)
                self._compiling.add(msg.request_id, msg.tenant, ticket, (msg, params, cache_epoch))
                return
            self.engine.add_request(msg.request_id, msg.prompt_token_ids, params, msg.tenant)
        except RequestRejected as exc:
            self._reject(msg, exc)

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

    def shutdown(self, reason: str) -> None:
        """Abort every request (running, queued, compiling), report them, say stopped."""
        live = self.engine.unfinished_ids()
        outputs = [self._abort_one(request_id, reason) for request_id in live]
        outputs += [_compile_aborted(msg, reason) for _, (msg, _, _) in self._compiling.cancel_all()]
        if outputs:
            self._send(OutputsMsg(outputs))
        self._send(EngineStoppedMsg(len(outputs)))
        self.is_stopped = True


class ColocatedLink:
    """The frontend's two sockets (PULL in, PUSH out) and, when started by it, its process."""

    def __init__(self, engine: LLMEngine, inbox: zmq.Socket, outbox: zmq.Socket, parent_fd: int | None) -> None:
        self.engine = engine
        self._inbox = inbox
        self._outbox = outbox
        self._parent_fd = parent_fd
        self._poller = zmq.Poller()
        self._poller.register(inbox, zmq.POLLIN)
        if parent_fd is not None:
            self._poller.register(parent_fd, zmq.POLLIN)
        self.steps = ColocatedSteps(engine, self.send)

    @property
    def is_stopped(self) -> bool:
        return self.steps.is_stopped

    def wait(self, timeout_ms: int) -> bool:
        events = dict(self._poller.poll(timeout_ms))
        if self._parent_fd is not None and self._parent_fd in events:
            logger.error("the frontend process is gone; aborting every request and exiting")
            self.steps.shutdown("frontend process exited")
        return bool(events)

    def receive(self) -> bool:
        changed = False
        while not self.is_stopped:
            try:
                data = self._inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return changed
            self.steps.handle(decode_to_engine(data))
            changed = True
        return changed

    def report_stats(self) -> None:
        self.send(stats_to_msg(self.engine.stats()))

    def send(self, msg: FromEngineMsg) -> None:
        self._outbox.send(encode(msg))


def colocated_loop(engine: LLMEngine, inbox: zmq.Socket, outbox: zmq.Socket,
                   parent_fd: int | None = None) -> EngineLoop:
    """The loop of an engine serving one frontend over `inbox`/`outbox`; `parent_fd` becomes
    readable when the frontend process ends (the engine then aborts everything and stops)."""
    link = ColocatedLink(engine, inbox, outbox, parent_fd)
    return EngineLoop(engine, link, link.steps, IDLE_POLL_MS)


def _compile_aborted(msg: AddRequestMsg, reason: str) -> RequestOutputMsg:
    """The end of a request still waiting for its grammar: it never reached the engine."""
    return RequestOutputMsg(msg.request_id, msg.tenant, [], "", True, "abort", None, len(msg.prompt_token_ids), 0, 0,
                            error=reason)
