"""A networked engine's link, the same for every role: its ROUTER, within the shared loop.

It plugs into `kvseal.engine.loop.EngineLoop` (which steps the engine and calls the role's
`tick` and `on_outputs`): it reads every waiting frame from the ROUTER (liveness, integrity and
shutdown here, the rest to the role's `handle`) and sends stats to the frontends that asked
(`HelloMsg`) when something changed, and at least every `PROBE_S`. It ends the work of a
frontend that is gone (`frontend_watch.py`). An undecodable frame is dropped and logged;
it never reaches the engine. Every frame comes from a peer whose key the ROUTER's CURVE
handshake accepted; a message its sender's role may not send is dropped, logged and counted
(`LinkGuard.allows`, I9) before anything reads its fields.
"""

from __future__ import annotations

import logging

import msgspec
import zmq

from kvseal.disagg.frontend_watch import FrontendWatch
from kvseal.disagg.link_auth import LinkGuard
from kvseal.disagg.msgs import (
    EngineInfoMsg,
    HelloMsg,
    IntegrityCheckMsg,
    IntegrityReportMsg,
    PdMsg,
    PdStatsMsg,
    decode,
)
from kvseal.disagg.role import FRONTEND_GONE, Replies, RoleSteps
from kvseal.engine.engine import LLMEngine
from kvseal.messages.convert import stats_to_msg
from kvseal.messages.msgs import ForgetTenantMsg, ShutdownMsg

logger = logging.getLogger("kvseal.disagg")

IDLE_POLL_MS = 50  # an idle engine still runs the role's deadlines this often


class RouterLink:
    def __init__(self, engine: LLMEngine, steps: RoleSteps, router: zmq.Socket, replies: Replies,
                 info: EngineInfoMsg, guard: LinkGuard, watch: FrontendWatch) -> None:
        """`router` has ZMQ_ROUTER_MANDATORY set: a send to a closed connection is refused, not dropped."""
        self.engine = engine
        self.guard = guard
        self.steps = steps
        self.router = router
        self.replies = replies
        self.info = info
        self.watch = watch
        self.is_stopped = False

    def wait(self, timeout_ms: int) -> bool:
        """Wait for the ROUTER, its handshake monitor, or data on the role's own sockets (taken in
        by its `tick`); True if the ROUTER has messages, the monitor a failed handshake, or the
        frontends are to be probed or one is found gone."""
        if self.watch.is_probe_due() or self.replies.has_unreachable:
            return True
        ours = [self.router, self.guard.monitor]
        readable, _, _ = zmq.select([*ours, *self.steps.wait_sockets()], [], [], timeout_ms / 1000)
        return any(socket in readable for socket in ours)

    def receive(self) -> bool:
        """Every waiting message first, then the frontends' liveness: a frontend is judged silent
        only after what it sent during a long engine step was read."""
        changed = self.guard.take_handshake_failures()
        while not self.is_stopped:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return self._end_gone_frontends() or changed
            changed = self._on_frames(frames) or changed
        return changed

    def _end_gone_frontends(self) -> bool:
        silent = []
        if self.watch.is_probe_due():
            self.report_stats()  # a send to a closed connection is refused: `replies` notes it
            silent = self.watch.probed()
        gone = [(f, f"silent for over {self.watch.timeout_s:g} s (--frontend-timeout-s)") for f in silent]
        gone += [(f, "its connection closed") for f in self.replies.take_unreachable()]
        for frontend, why in gone:
            self._end_frontend(frontend, why)
        return bool(gone)

    def _end_frontend(self, frontend: bytes, why: str) -> None:
        """End everything of a gone frontend, in one log line. A connection that never said hello
        and held nothing (a test's or a tool's), or one ended already, is not logged."""
        name = self.watch.forget(frontend)
        num_ended = self.steps.abort_frontend(frontend, FRONTEND_GONE)
        if name is None and num_ended == 0:
            return
        logger.log(logging.WARNING if num_ended else logging.INFO,
                   "frontend %s is gone (%s): ended the %d request(s) it had on this engine (running, prefill jobs, "
                   "reservations); their pages are freed", name or "that said no hello", why, num_ended)

    def _on_frames(self, frames: list[zmq.Frame]) -> bool:
        """[sender, header, payload...]; the payload frames stay in ZMQ's buffers."""
        if len(frames) < 2:
            logger.error("dropping a message of %d frames", len(frames))
            return False
        sender, payload = frames[0].bytes, [frame.buffer for frame in frames[2:]]
        identity = self.guard.identify(frames[1])
        try:
            msg = decode(frames[1].bytes)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.error("dropping an undecodable message from %s: %s", identity or "an unknown key", exc)
            return False
        if not self.guard.allows(identity, msg):
            return True  # refused and counted: the stats changed
        if isinstance(msg, HelloMsg):
            self.watch.hello(sender, f"{identity} (id {msg.frontend_id})")
        self.watch.heard(sender)
        return self._dispatch(sender, msg, payload)

    def _dispatch(self, sender: bytes, msg: PdMsg, payload: list[memoryview]) -> bool:
        match msg:
            case HelloMsg():
                self.replies.send(sender, self.info)
                self.replies.send(sender, self.stats())
                return False
            case IntegrityCheckMsg():
                self.replies.send(sender, self.integrity_report())
                return False
            case ForgetTenantMsg():  # both roles keep a prefix cache
                self.engine.forget_tenant(msg.tenant, msg.request_ids)
                return True
            case ShutdownMsg():
                self.steps.abort_all(msg.reason)
                self.is_stopped = True
                return True
        if not self.steps.handle(sender, msg, payload):
            logger.error("a %s engine does not take %s; dropped", self.steps.role, type(msg).__name__)
            return False
        return True

    def stats(self) -> PdStatsMsg:
        c = self.steps.counters
        return PdStatsMsg(
            instance_id=self.info.instance_id, role=self.steps.role,
            engine=stats_to_msg(self.engine.stats()),
            num_pages_total=self.engine.cache_config.num_pages, num_reservations=self.steps.num_reservations(),
            num_transfers=c.num_transfers, num_transfer_bytes=c.num_transfer_bytes,
            transfer_s_total=c.transfer_s_total, handoff_failures=dict(c.failures),
            num_reservations_expired=c.num_reservations_expired,
            refused_handshakes=dict(self.guard.refused_handshakes),
            num_refused_messages=self.guard.num_refused_messages,
        )

    def report_stats(self) -> None:
        stats = self.stats()
        for frontend in self.watch.frontends:
            self.replies.send(frontend, stats)

    def integrity_report(self) -> IntegrityReportMsg:
        try:
            self.check_integrity()
            error = None
        except AssertionError as exc:
            error = str(exc) or "integrity check failed"
        return IntegrityReportMsg(self.info.instance_id, error, self.engine.kv.num_used_pages,
                                  self.steps.num_reservations(), len(self.engine.unfinished_ids()))

    def check_integrity(self) -> None:
        """For tests: the engine's invariants, with the role's held requests (reservations)."""
        self.engine.check_integrity(self.steps.held())
