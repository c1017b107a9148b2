"""The decode role's steps: reserve, receive, verify, then run like any engine
(docs/ARCHITECTURE.md, "Prefill/decode disaggregation").

Nothing of a handed-off request runs before `verify_commit` accepted it. Every way a
reservation can end (commit refused, prefill's abort, the frontend's abort or its going away,
expiry) releases
its pages under the reservation table's rule and reports one terminal, non-success output.

Prefix cache (I5): a reservation starts on its hit in decode's cache (the namespace decode
derives from the request's tenant), reported as `ReservedMsg.num_cached_tokens`; the transfer and the
verification cover the prompt from there on, and after a verified commit the newly written
full pages are published (`add_prefilled`), so the tenant's next request hits them.
"""

from __future__ import annotations

import logging
import math
import socket
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from kvseal._testing.faults import Fault, is_active
from kvseal.admission import admit
from kvseal.disagg.msgs import (
    HANDOFF_FAILED,
    AbortUnsentMsg,
    CommitMsg,
    KVBlockMsg,
    PdMsg,
    ReservedMsg,
    ReserveMsg,
    ReserveRefusedMsg,
    Role,
    TransferAbortMsg,
    TransferKeepaliveMsg,
)
from kvseal.disagg.reservations import Reservation, ReservationTable
from kvseal.disagg.role import HandoffCounters, Replies, abort_every, abort_owned, aborted_output
from kvseal.disagg.transport import CANCELLED, KVReceiver, log_refused_block
from kvseal.disagg.verify import Expected, Refusal, verify_commit
from kvseal.engine.engine import LLMEngine
from kvseal.errors import RequestRejected
from kvseal.messages.convert import logprobs_from_msg, output_to_msg, params_from_msg, timing_from_msg
from kvseal.messages.msgs import AbortMsg, OutputsMsg, RequestOutputMsg, RequestRejectedMsg
from kvseal.parallel.handoff import RankHandoff
from kvseal.structured.pending import PendingGrammars
from kvseal.types import ISOLATION_CHECK_FAILED, RequestOutput, RequestTiming, SamplingParams

logger = logging.getLogger("kvseal.disagg")

RECEIVING_POLL_MS = 2  # how often an idle decode engine holding reservations takes in landed KV


@dataclass(frozen=True)
class _AskedReservation:
    """A reservation request that passed decode's re-check, waiting for its grammar to compile."""

    frontend: bytes
    msg: ReserveMsg
    prompt: list[int]
    params: SamplingParams
    cache_epoch: int  # the tenant's when the reservation was asked for (`LLMEngine.arrival_epoch`)


# the end of a request whose reservation was released: an aborted output's (error, error_code), or
# prefill's refusal relayed as it came
_End = tuple[str, str | None] | RequestRejectedMsg


class DecodeSteps:
    role: Role = "decode"

    def __init__(self, engine: LLMEngine, receiver: KVReceiver, replies: Replies, reservation_timeout_s: float,
                 instance_id: str, handoff: RankHandoff | None = None) -> None:
        self.engine = engine
        self.receiver = receiver
        self.handoff = handoff  # tensor parallelism: a verified handoff is scattered to the ranks
        self.table = ReservationTable(engine.kv, receiver, reservation_timeout_s)
        self.replies = replies
        self.instance_id = instance_id
        self.counters = HandoffCounters()
        self._frontend_of: dict[str, bytes] = {}  # running handed-off request -> who gets its outputs
        # releasing reservation -> the end its client gets once the release completes: an aborted
        # output's error and code, or prefill's refusal as it came
        self._pending_errors: dict[str, _End] = {}
        # transfer -> its commit, held until the receiver took in every write made before it
        # (a transport whose data does not share the commit's connection: tcp-stream)
        self._parked: dict[str, CommitMsg] = {}
        # structured-output reservations whose grammar compiles off the loop (no pages held yet):
        # a grammar that cannot compile is refused before any page is reserved
        self._compiling: PendingGrammars[_AskedReservation] = PendingGrammars()

    def held(self) -> set[str]:
        return self.table.request_ids()

    def num_reservations(self) -> int:
        return len(self.table)

    def poll_ms(self, idle_poll_ms: int) -> int:
        """While it holds reservations, a transport whose writes land outside the ROUTER (NIXL)
        is taken in by `tick` while the rest is still on the wire: wake often."""
        return min(idle_poll_ms, RECEIVING_POLL_MS) if len(self.table) else idle_poll_ms

    def wait_sockets(self) -> list[socket.socket]:
        return self.receiver.fds()

    def handle(self, sender: bytes, msg: PdMsg, payload: list[memoryview]) -> bool:
        match msg:
            case ReserveMsg():
                self._reserve(sender, msg)
            case KVBlockMsg():
                self._receive(msg, payload)
            case CommitMsg():
                self._commit(msg)
            case TransferAbortMsg():
                self._transfer_abort(msg)
            case TransferKeepaliveMsg():
                self._keepalive(msg)
            case AbortMsg() | AbortUnsentMsg():
                self._abort(sender, msg)
            case _:
                return False
        return True

    # ---- step 1: reserve --------------------------------------------------------------

    def _reserve(self, frontend: bytes, msg: ReserveMsg) -> None:
        try:
            params = params_from_msg(msg.params)
            prompt = admit(msg.prompt_token_ids, params, self.engine.limits)  # I1, decode's own limits
            if (self.table.has_request(msg.request_id) or self.engine.find(msg.request_id) is not None
                    or msg.request_id in self._compiling):
                raise RequestRejected(f"request id {msg.request_id!r} is already in use on this decode engine")
        except RequestRejected as exc:
            self._refuse_reservation(frontend, msg, exc)
            return
        asked = _AskedReservation(frontend, msg, prompt, params, self.engine.arrival_epoch(msg.request_id, msg.tenant))
        if params.structured is not None:  # compiled off the loop; reserved once it compiled (`tick`)
            ticket = self.engine.grammars.compile(msg.tenant, params.structured)
            self._compiling.add(msg.request_id, msg.tenant, ticket, asked)
            return
        self._add_reservation(asked, None)

    def _add_reservation(self, asked: _AskedReservation, compiled_grammar: Any) -> None:
        msg = asked.msg
        self.table.add(Reservation(msg.request_id, msg.tenant, asked.prompt, asked.params, asked.frontend,
                                   compiled_grammar=compiled_grammar, cache_epoch=asked.cache_epoch))
        self._place_waiting()

    def _refuse_reservation(self, frontend: bytes, msg: ReserveMsg, exc: RequestRejected) -> None:
        logger.warning("decode re-check refused request %s: %s", msg.request_id, exc.message)
        self.replies.send(frontend, ReserveRefusedMsg(msg.request_id, msg.tenant, exc.code, exc.message,
                                                      exc.param, exc.http_status))

    def _reserve_compiled(self) -> bool:
        """Reserve for the requests whose grammar compiled; refuse those whose grammar did not."""
        ready = self._compiling.take_ready()
        for waiting in ready:
            try:
                compiled = waiting.ticket.result()
            except RequestRejected as exc:
                self._refuse_reservation(waiting.item.frontend, waiting.item.msg, exc)
                continue
            self._add_reservation(waiting.item, compiled)
        return bool(ready)

    def _place_waiting(self) -> bool:
        placed = self.table.place_waiting()
        for r in placed:
            kv_address = self.receiver.address_for(r.transfer_id)
            self.replies.send(r.frontend, ReservedMsg(r.request_id, r.tenant, r.transfer_id, list(r.pages),
                                                      self.engine.kv.page_size, kv_address, r.transfer_key,
                                                      r.num_cached_tokens))
        return bool(placed)

    # ---- step 3: KV lands -------------------------------------------------------------

    def _receive(self, msg: KVBlockMsg, payload: list[memoryview]) -> None:
        why = self.receiver.deliver(msg, payload) if payload else "missing_payload"
        if why is not None:
            self.counters.failures[why] += 1
            log_refused_block(msg.transfer_id, why)

    # ---- step 4: verify the commit, then run ------------------------------------------

    def _commit(self, msg: CommitMsg) -> None:
        """Verify a commit that names a live reservation, now or once its data caught up (parked).
        Its identity is checked first: a commit that is not the reservation's raises its alarm and
        touches nothing, so it can neither hold the transfer nor replace its real commit."""
        reservation = self.table.by_transfer(msg.transfer_id)
        if not _is_named(reservation, msg):
            self._refuse_unmatched(msg, reservation)
            return
        self.receiver.sender_done(msg.transfer_id)  # prefill commits only after its last write ended
        if msg.transfer_id in self._parked:
            self._refuse_second_commit(msg)
        elif self.receiver.settled(msg.transfer_id):
            self._verify(reservation, msg)
        else:
            self._parked[msg.transfer_id] = msg  # verified in `tick` once the data caught up

    def _refuse_second_commit(self, msg: CommitMsg) -> None:
        """Prefill commits a transfer once: the first commit stays parked and decides; another is an alarm."""
        self.counters.failures["duplicate_commit"] += 1
        logger.error("refused a second commit for transfer %s (request %s): the first one is waiting for "
                     "its data and stands", msg.transfer_id, msg.request_id)

    def _verify(self, reservation: Reservation, msg: CommitMsg) -> None:
        expected = Expected(reservation.transfer_id, reservation.request_id, reservation.tenant,
                            reservation.num_prompt_tokens, self.engine.model_config.num_layers,
                            self.engine.limits.vocab_size, reservation.params.logprobs,
                            reservation.num_cached_tokens, reservation.params.prompt_logprobs,
                            tuple(reservation.prompt_token_ids), reservation.params.allowed_token_ids)
        refusal = None if is_active(Fault.SKIP_HANDOFF_VERIFY) else verify_commit(
            expected, msg, self.receiver.landed(msg.transfer_id))
        if refusal is None and self.handoff is not None:
            refusal = self._scatter(reservation)
        if refusal is not None:
            logger.error("handoff of request %s (transfer %s from %s) refused: %s", msg.request_id,
                         msg.transfer_id, msg.prefill_engine, refusal.message)
            self.counters.failures[refusal.reason] += 1
            self._end_reservation(reservation, refusal.reason,
                                  f"isolation check failed: KV handoff verification: {refusal.message}",
                                  ISOLATION_CHECK_FAILED)
            return
        self._start(reservation, msg)

    def _refuse_unmatched(self, msg: CommitMsg | TransferAbortMsg, reservation: Reservation | None) -> None:
        """Refuse a commit or transfer abort no live reservation matches; the reservation, if any,
        is not touched. A late one of a reservation released here (the client went away, an
        abort, an expiry: its request id and tenant match) is `CANCELLED`, logged at INFO; any
        other, a forged or stale one, is an alarm logged at ERROR."""
        what = "commit" if isinstance(msg, CommitMsg) else "transfer abort"
        released = self.table.released(msg.transfer_id)
        if reservation is None and released is not None and \
                (released.request_id, released.tenant) == (msg.request_id, msg.tenant):
            self.receiver.sender_done(msg.transfer_id)  # prefill's own: its last write ended before it
            self.counters.failures[CANCELLED] += 1
            logger.info("dropped a late %s for transfer %s (request %s): its reservation was already "
                        "released (%s)", what, msg.transfer_id, msg.request_id, released.reason)
            return
        self.counters.failures["unknown_transfer" if reservation is None else "identity_mismatch"] += 1
        logger.error("refused a %s for transfer %s (request %s): no matching reservation", what, msg.transfer_id,
                     msg.request_id)

    def _scatter(self, reservation: Reservation) -> Refusal | None:
        """Tensor parallelism: every rank takes its heads of the verified KV; a rank whose own
        records do not show all of it refuses the handoff on every rank (I4, per rank)."""
        assert self.handoff is not None
        why = self.handoff.scatter(reservation.request_id, list(reservation.pages), reservation.num_cached_tokens,
                                   reservation.num_prompt_tokens)
        if why is None or is_active(Fault.SKIP_HANDOFF_VERIFY):
            return None
        return Refusal("missing_kv_on_rank", why)

    def _start(self, reservation: Reservation, msg: CommitMsg) -> None:
        landing = self.receiver.landed(msg.transfer_id)
        kv, request_id = self.engine.kv, reservation.request_id
        for layer in range(self.engine.model_config.num_layers):  # [0, hit) is recorded since the hit
            kv.record_written(request_id, layer, reservation.num_cached_tokens, reservation.num_prompt_tokens)
        self.table.take(reservation)
        self.counters.num_transfers += 1
        self.counters.num_transfer_bytes += landing.num_bytes if landing is not None else 0
        logprobs = None if msg.first_logprobs is None else logprobs_from_msg(msg.first_logprobs)
        prompt_logprobs = None if msg.prompt_logprobs is None else [
            None if lp is None else logprobs_from_msg(lp) for lp in msg.prompt_logprobs]
        generator_state = torch.frombuffer(bytearray(msg.generator_state), dtype=torch.uint8)  # verified
        first = self.engine.add_prefilled(request_id, reservation.tenant, reservation.prompt_token_ids,
                                          reservation.params, msg.first_token, logprobs, generator_state,
                                          reservation.num_cached_tokens,
                                          reservation.compiled_grammar, prompt_logprobs,
                                          _prefill_timing(msg), cache_epoch=reservation.cache_epoch)
        logger.info("handoff of request %s verified: transfer %s from prefill %s to decode %s",
                    request_id, msg.transfer_id, msg.prefill_engine, self.instance_id)
        self._frontend_of[request_id] = reservation.frontend
        self.on_outputs([first])

    def _keepalive(self, msg: TransferKeepaliveMsg) -> None:
        """Prefill still holds the reservation's request: its deadline starts again. One for a
        reservation released here lately is dropped quietly (prefill hears of the end through
        the frontend's abort); one that names no reservation, or another's, is an alarm."""
        reservation = self.table.by_transfer(msg.transfer_id)
        if _is_named(reservation, msg):
            self.table.restart_deadline(reservation)
            return
        released = self.table.released(msg.transfer_id)
        if reservation is None and released is not None and \
                (released.request_id, released.tenant) == (msg.request_id, msg.tenant):
            return
        self.counters.failures["unknown_transfer" if reservation is None else "identity_mismatch"] += 1
        logger.error("refused a keepalive for transfer %s (request %s): no matching reservation", msg.transfer_id,
                     msg.request_id)

    # ---- every other end of a reservation ---------------------------------------------

    def _transfer_abort(self, msg: TransferAbortMsg) -> None:
        reservation = self.table.by_transfer(msg.transfer_id)
        if not _is_named(reservation, msg):
            self._refuse_unmatched(msg, reservation)
            return
        self.receiver.sender_done(msg.transfer_id)  # prefill aborts only after its last write ended
        self.counters.failures["prefill_refused"] += 1
        if msg.code == ISOLATION_CHECK_FAILED:  # prefill's own check ended it: a failure, not a rejection
            self._end_reservation(reservation, "prefill_refused", msg.message, ISOLATION_CHECK_FAILED)
            return
        refusal = RequestRejectedMsg(msg.request_id, msg.tenant, msg.code, msg.message, msg.param, msg.http_status)
        if self.table.release(reservation, "prefill_refused"):
            self.replies.send(reservation.frontend, refusal)
        else:  # reported as it came once the transport confirms no write can land (`tick`)
            self._pending_errors[reservation.request_id] = refusal

    def _abort(self, frontend: bytes, msg: AbortMsg | AbortUnsentMsg) -> None:
        """End the request `msg` names, if its tenant's: compiling, reserved or running. A
        reservation already releasing keeps the end it was first given (the client hears why
        it was stopped, not a later abort's words); `AbortUnsentMsg` from the frontend that asked
        for it frees it at once, as no prefill engine holds its transfer."""
        asked = self._compiling.cancel(msg.request_id, msg.tenant)  # its compile is cancelled too
        if asked is not None:
            self.counters.failures["aborted"] += 1
            self._report_unreserved(asked, msg.reason)
            return
        reservation = self.table.by_request(msg.request_id)
        if reservation is None or reservation.tenant != msg.tenant:
            self.on_outputs(abort_owned(self.engine, msg))
            return
        if isinstance(msg, AbortUnsentMsg) and reservation.frontend == frontend:
            self.receiver.sender_done(reservation.transfer_id)  # no sender exists: nothing will write it
        if reservation.release_reason is None:
            self.counters.failures["aborted"] += 1
            self._end_reservation(reservation, "aborted", msg.reason, None)

    def _end_reservation(self, reservation: Reservation, reason: str, error: str, error_code: str | None) -> None:
        if self.table.release(reservation, reason):
            self._report_end(reservation, error, error_code)
        else:  # reported once the transport confirms no write can land (`tick`)
            self._pending_errors[reservation.request_id] = (error, error_code)

    def _report_unreserved(self, asked: _AskedReservation, error: str, error_code: str | None = None) -> None:
        """The end of a request aborted while its grammar compiled: it never held a page."""
        out = aborted_output(asked.msg.request_id, asked.msg.tenant, len(asked.prompt), 0, error, error_code)
        self.replies.send(asked.frontend, OutputsMsg([out]))

    def _report_pending(self, reservation: Reservation, end: _End) -> None:
        if isinstance(end, RequestRejectedMsg):
            self.replies.send(reservation.frontend, end)
        else:
            self._report_end(reservation, *end)

    def _report_end(self, reservation: Reservation, error: str, error_code: str | None) -> None:
        out = aborted_output(reservation.request_id, reservation.tenant, reservation.num_prompt_tokens,
                             len(reservation.pages), error, error_code)
        self.replies.send(reservation.frontend, OutputsMsg([out]))

    def tick(self) -> bool:
        self.receiver.progress()  # what landed since the last iteration is copied in now, not at the commit
        self.counters.failures.update(self.receiver.take_refusals())
        changed = self._reserve_compiled()
        changed = self._verify_parked() or changed
        for reservation in self.table.expired():
            self.counters.num_reservations_expired += 1
            self.counters.failures["expired"] += 1
            logger.error("reservation of request %s (transfer %s) heard nothing of its prefill for %g s (no "
                         "keepalive, KV or commit); releasing it", reservation.request_id, reservation.transfer_id,
                         self.table.timeout_s)
            self._end_reservation(reservation, "expired",
                                  f"no sign of the prefill engine (keepalive, KV or commit) for "
                                  f"{self.table.timeout_s:g} s (--reservation-timeout-s)", HANDOFF_FAILED)
            changed = True
        for reservation in self.table.retry_releases():
            # the end recorded when its release was asked for, with its own code (an abort's none,
            # prefill's refusal its own); a release no end was recorded for is a failed handoff
            end = self._pending_errors.pop(reservation.request_id,
                                           (reservation.release_reason or "released", HANDOFF_FAILED))
            self._report_pending(reservation, end)
            changed = True
        return self._place_waiting() or changed

    def _verify_parked(self) -> bool:
        """Verify the held commits whose data caught up; drop those whose reservation ended
        (released or expired: nothing is left to verify)."""
        changed = False
        for transfer_id, msg in list(self._parked.items()):
            reservation = self.table.by_transfer(transfer_id)
            if reservation is None:
                del self._parked[transfer_id]
            elif self.receiver.settled(transfer_id):
                del self._parked[transfer_id]
                self._verify(reservation, msg)
                changed = True
        return changed

    def abort_all(self, reason: str, error_code: str | None = None) -> None:
        for _, asked in self._compiling.cancel_all():
            self._report_unreserved(asked, reason, error_code)
        for request_id in list(self.table.request_ids()):
            reservation = self.table.by_request(request_id)
            if reservation is not None:
                self._end_reservation(reservation, "aborted", reason, error_code)
        self.on_outputs(abort_every(self.engine, reason, error_code))

    def abort_frontend(self, frontend: bytes, reason: str) -> int:
        """End what a gone frontend asked for: its compiling and held reservations (released
        under the table's rule) and its running requests. Each end is still reported to it."""
        compiling = self._compiling.cancel_matching(lambda asked: asked.frontend == frontend)
        for _, asked in compiling:
            self.counters.failures["aborted"] += 1  # as `_abort` counts a compiling one
            self._report_unreserved(asked, reason)
        reservations = self.table.of_frontend(frontend)
        for reservation in reservations:
            self.counters.failures["aborted"] += 1
            self._end_reservation(reservation, "aborted", reason, None)
        running = [rid for rid, owner in self._frontend_of.items() if owner == frontend]
        outputs = [out for out in (self.engine.abort(rid, reason) for rid in running) if out is not None]
        self.on_outputs(outputs)
        return len(compiling) + len(reservations) + len(outputs)

    # ---- outputs of running handed-off requests -----------------------------------------

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        by_frontend: dict[bytes, list[RequestOutputMsg]] = {}
        for out in outputs:
            frontend = self._frontend_of.get(out.request_id)
            if out.finished:
                self._frontend_of.pop(out.request_id, None)
            if frontend is not None:
                by_frontend.setdefault(frontend, []).append(output_to_msg(out))
        for frontend, msgs in by_frontend.items():
            self.replies.send(frontend, OutputsMsg(msgs))


def _prefill_timing(msg: CommitMsg) -> RequestTiming | None:
    """Prefill's queue and prefill durations, for /metrics only (nothing else reads them): left out
    unless each is a finite duration of at least 0."""
    timing = timing_from_msg(msg.prefill_timing)
    if timing is None or not all(math.isfinite(s) and s >= 0 for s in (timing.queue_s, timing.prefill_s)):
        return None
    return timing


def _is_named(reservation: Reservation | None,
              msg: CommitMsg | TransferAbortMsg | TransferKeepaliveMsg) -> TypeGuard[Reservation]:
    """Whether `msg` is the live `reservation`'s own: its request id and tenant, not only its transfer id."""
    return reservation is not None and (reservation.request_id, reservation.tenant) == (msg.request_id, msg.tenant)
