"""The prefill role's steps: re-admit, compute the prompt's KV and first token, push, commit.

A request prefill refuses is terminal here too: nothing is computed, and decode is told with
`TransferAbortMsg` so it releases the reservation (the incident's engine instead computed a
one-token placeholder and transferred it). What is pushed and committed comes from prefill's
own write records (`written_prefix`), never from what the scheduler believes it computed.

Keepalive: while it holds a request (queued, its grammar compiling, computing) prefill tells
decode so every `keepalive_interval_s`, between engine steps (`TransferKeepaliveMsg`): decode's
reservation deadline catches a prefill that stopped, not one that is slow or busy.

Prefix cache: prefill computes the whole prompt (it needs every position to sample the first
token), starting on its own cache hit in the tenant's namespace where it has one, and pushes
only positions from decode's hit (`PrefillMsg.num_cached_tokens`) on.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time
from dataclasses import dataclass
from typing import Any

from kvseal.admission import admit
from kvseal.disagg.link_keys import EngineLinkKeys
from kvseal.disagg.msgs import (
    INVALID_PREFILL_MSG,
    TRANSFER_FAILED,
    CommitMsg,
    PdMsg,
    PrefillDoneMsg,
    PrefillMsg,
    PrefillRefusedMsg,
    Role,
    TransferAbortMsg,
    TransferKeepaliveMsg,
    WrittenRangeMsg,
)
from kvseal.disagg.prefill_check import MalformedPrefillMsg, check_handoff, check_prefill_msg
from kvseal.disagg.role import HandoffCounters, Replies, abort_every, abort_owned
from kvseal.disagg.transport import KVSender, PushPlan, TransportError
from kvseal.disagg.wire import PeerLink, PeerLinks
from kvseal.engine.engine import LLMEngine
from kvseal.errors import RequestRejected
from kvseal.messages.convert import logprobs_to_msg, params_from_msg, prompt_logprobs_to_msg, timing_to_msg
from kvseal.messages.msgs import AbortMsg
from kvseal.parallel.handoff import RankHandoff
from kvseal.structured.pending import PendingGrammars
from kvseal.types import (
    ENGINE_UNAVAILABLE,
    ISOLATION_CHECK_FAILED,
    NO_TOKEN_SATISFIES_CONSTRAINTS,
    FinishReason,
    Request,
    RequestOutput,
    SamplingParams,
    no_token_param,
)

logger = logging.getLogger("kvseal.disagg")

REQUEST_ABORTED = "request_aborted"  # prefill's engine ended the request for any other reason


@dataclass
class Job:
    """One handoff in progress on this prefill engine."""

    msg: PrefillMsg
    frontend: bytes
    started_s: float
    result: PrefillDoneMsg | PrefillRefusedMsg | None = None
    keepalive_s: float = 0.0  # when decode last heard that prefill holds it (the job's start, at first)


def first_token_params(params: SamplingParams) -> SamplingParams:
    """What prefill samples with: exactly the request's first draw (min_tokens and stop-token
    bans apply as they would to the first token), then it stops; decode continues."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), stop=(),
                               truncate_prompt_tokens=None)


class PrefillSteps:
    role: Role = "prefill"

    def __init__(self, engine: LLMEngine, sender: KVSender, links: PeerLinks, replies: Replies,
                 instance_id: str, keys: EngineLinkKeys, handoff: RankHandoff | None = None, *,
                 keepalive_interval_s: float) -> None:
        self.engine = engine
        self.keepalive_interval_s = keepalive_interval_s
        self.keys = keys  # a decode key a PrefillMsg names must be neither this engine's nor a frontend's
        self.sender = sender
        self.handoff = handoff  # tensor parallelism: the ranks' heads are gathered before a push
        self.links = links
        self.replies = replies
        self.instance_id = instance_id
        self.counters = HandoffCounters()
        self._jobs: dict[str, Job] = {}
        # structured-output jobs whose grammar compiles off the loop (not yet in the engine)
        # (with the cache epoch each arrived in, `LLMEngine.arrival_epoch`)
        self._compiling: PendingGrammars[tuple[Job, list[int], SamplingParams, int]] = PendingGrammars()
        engine.before_free = self._hand_off

    def held(self) -> set[str]:
        return set()

    def num_reservations(self) -> int:
        return 0

    def poll_ms(self, idle_poll_ms: int) -> int:
        return idle_poll_ms

    def wait_sockets(self) -> list[socket.socket]:
        return []  # prefill's sends block in `push`: nothing to wake for

    def handle(self, sender: bytes, msg: PdMsg, payload: list[memoryview]) -> bool:
        match msg:
            case PrefillMsg():
                self._prefill(sender, msg)
            case AbortMsg():
                self._abort(msg)
            case _:
                return False
        return True

    def _prefill(self, frontend: bytes, msg: PrefillMsg) -> None:
        now_s = time.monotonic()
        job = Job(msg, frontend, now_s, keepalive_s=now_s)
        try:
            check_prefill_msg(msg, self.keys.own.public, self.keys.frontends)  # before `_refuse` may use decode's link
            params = params_from_msg(msg.params)
            prompt = admit(msg.prompt_token_ids, params, self.engine.limits)  # I1, prefill's own limits
            check_handoff(msg, len(prompt), self.engine.kv.page_size)
            if msg.request_id in self._compiling:
                raise RequestRejected(f"request id {msg.request_id!r} is already in use on this prefill engine")
        except MalformedPrefillMsg as exc:
            self._refuse_malformed(job, exc)
            return
        except RequestRejected as exc:
            self._refuse_rejected(job, exc)
            return
        cache_epoch = self.engine.arrival_epoch(msg.request_id, msg.tenant)
        if params.structured is not None:  # compiled off the loop; started once it compiled (`tick`)
            ticket = self.engine.grammars.compile(msg.tenant, params.structured)
            self._compiling.add(msg.request_id, msg.tenant, ticket, (job, prompt, params, cache_epoch))
            return
        self._start(job, prompt, params, None, cache_epoch)

    def _start(self, job: Job, prompt: list[int], params: SamplingParams, compiled_grammar: Any,
               cache_epoch: int) -> None:
        msg = job.msg
        try:
            self.engine.add_request(msg.request_id, prompt, first_token_params(params), msg.tenant,
                                    compiled_grammar=compiled_grammar, cache_epoch=cache_epoch)
        except RequestRejected as exc:
            self._refuse_rejected(job, exc)
            return
        self._jobs[msg.request_id] = job

    def _refuse_rejected(self, job: Job, exc: RequestRejected) -> None:
        logger.warning("prefill re-check refused request %s: %s", job.msg.request_id, exc.message)
        self._refuse(job, exc.code, exc.message, exc.param, exc.http_status)
        self._report(job)

    def _refuse_malformed(self, job: Job, exc: MalformedPrefillMsg) -> None:
        """Answer the sender only: nothing a malformed message names (decode's address and key) is
        contacted; the frontend ends decode's reservation itself."""
        msg = job.msg
        logger.error("refused a malformed PrefillMsg (request %.64r): %s", msg.request_id, exc)
        self.counters.failures[INVALID_PREFILL_MSG] += 1
        job.result = PrefillRefusedMsg(msg.request_id, msg.transfer_id, self.instance_id, INVALID_PREFILL_MSG,
                                       f"the prefill engine refused the handoff message: {exc}", None, 502)
        self._report(job)

    def _start_compiled(self) -> bool:
        """Start the jobs whose grammar compiled; refuse those whose grammar did not."""
        ready = self._compiling.take_ready()
        for waiting in ready:
            job, prompt, params, cache_epoch = waiting.item
            try:
                compiled = waiting.ticket.result()
            except RequestRejected as exc:
                self._refuse_rejected(job, exc)
                continue
            self._start(job, prompt, params, compiled, cache_epoch)
        return bool(ready)

    def _abort(self, msg: AbortMsg) -> None:
        compiling = self._compiling.cancel(msg.request_id, msg.tenant)  # its compile is cancelled too
        if compiling is None:
            self.on_outputs(abort_owned(self.engine, msg))
            return
        job = compiling[0]
        self._refuse(job, REQUEST_ABORTED, f"prefill did not complete the request: {msg.reason}", None, 500)
        self._report(job)

    def _hand_off(self, request: Request) -> None:
        """The engine's `before_free` hook: the request still owns its pages here."""
        job = self._jobs.get(request.request_id)
        if job is None or request.finish_reason is FinishReason.ABORT:
            return  # nothing is pushed; `on_outputs` refuses it with the cause its output carries
        try:
            num_bytes = self._push(job, request)
        except TransportError as exc:
            logger.error("KV transfer of request %s to %s failed: %s", request.request_id, job.msg.kv_address, exc)
            self.counters.failures["transport_error"] += 1
            self._refuse(job, TRANSFER_FAILED, f"the KV transfer to decode failed: {exc}", None, 502)
            return
        elapsed_s = time.monotonic() - job.started_s
        self.counters.num_transfers += 1
        self.counters.num_transfer_bytes += num_bytes
        self.counters.transfer_s_total += elapsed_s
        job.result = PrefillDoneMsg(request.request_id, job.msg.transfer_id, self.instance_id,
                                    request.num_computed_tokens, num_bytes, elapsed_s)

    def _push(self, job: Job, request: Request) -> int:
        kv, msg = self.engine.kv, job.msg
        start = msg.num_cached_tokens  # decode holds [0, start) in its own cache: not sent
        pages = kv.allocator.pages_of(request.request_id)
        pool, written, staged = kv.pool, kv.written_prefix(request.request_id), pages[start // kv.page_size:]
        if self.handoff is not None:  # every rank's heads, and what every rank wrote (the least of them)
            pool, written = self.handoff.wire, self.handoff.gather(request.request_id, staged)
        plan = PushPlan(msg.transfer_id, pages, written, msg.kv_address, list(msg.pages), start,
                        transfer_key=msg.transfer_key, decode_key=msg.decode_public_key)
        try:
            num_bytes = self.sender.push(plan, pool)
        finally:
            if self.handoff is not None:  # the push returned: nothing reads the staged pages any more
                self.handoff.clear(staged)
        first = request.output_logprobs[0] if request.output_logprobs else None
        assert request.generator is not None, "every engine request samples with its own generator"
        commit = CommitMsg(
            transfer_id=msg.transfer_id, request_id=request.request_id, tenant=request.tenant,
            num_tokens=request.num_computed_tokens,
            written=[WrittenRangeMsg(layer, start, end) for layer, end in enumerate(written)],
            first_token=request.output_token_ids[0],
            first_logprobs=None if first is None else logprobs_to_msg(first),
            generator_state=request.generator.get_state().numpy().tobytes(), prefill_engine=self.instance_id,
            prompt_logprobs=prompt_logprobs_to_msg(request.prompt_logprobs),
            prefill_timing=timing_to_msg(request.timing()),
        )
        self.links.get(msg.decode_address, msg.decode_public_key).send(commit)
        return num_bytes

    def _refuse(self, job: Job, code: str, message: str, param: str | None, http_status: int) -> None:
        """Tell decode to release the reservation (best effort: it also expires), and the frontend."""
        msg = job.msg
        self.counters.failures[code] += 1
        abort = TransferAbortMsg(msg.transfer_id, msg.request_id, msg.tenant, code, message, param, http_status,
                                 self.instance_id)
        try:
            self.links.get(msg.decode_address, msg.decode_public_key).send(abort)
        except TransportError as exc:
            logger.error("could not tell decode %s to release transfer %s: %s", msg.decode_address,
                         msg.transfer_id, exc)
        job.result = PrefillRefusedMsg(msg.request_id, msg.transfer_id, self.instance_id, code, message, param,
                                       http_status)

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished and out.request_id in self._jobs:
                job = self._jobs.pop(out.request_id)
                if job.result is None:  # ended before its hand-off
                    self._refuse_aborted(job, out)
                self._report(job)

    def _refuse_aborted(self, job: Job, out: RequestOutput) -> None:
        """Prefill's engine aborted the request: decode and the client get the engine's cause,
        `isolation_check_failed` when prefill's own isolation check refused a forward (I3/I4),
        `no_token_satisfies_constraints` (400) when the request's grammar (with its
        allowed_token_ids, or alone) left its first token nothing to be, `engine_unavailable`
        (503) when this engine was lost (a tensor-parallel rank died): the client's answer and
        audit are an engine loss's, never a rejection of the request."""
        if out.error_code == ENGINE_UNAVAILABLE:
            self._refuse(job, ENGINE_UNAVAILABLE, out.error or "the prefill engine was lost", None, 503)
        elif out.error_code == ISOLATION_CHECK_FAILED:
            self._refuse(job, ISOLATION_CHECK_FAILED, out.error or "isolation check failed in prefill", None, 500)
        elif out.error_code == NO_TOKEN_SATISFIES_CONSTRAINTS:  # the client's constraints, as in one engine
            self._refuse(job, NO_TOKEN_SATISFIES_CONSTRAINTS, out.error or "no token satisfies the constraints",
                         no_token_param(out.error), 400)
        else:
            self._refuse(job, REQUEST_ABORTED, f"prefill did not complete the request: {out.error or 'aborted'}",
                         None, 500)

    def _report(self, job: Job) -> None:
        assert job.result is not None, "a finished prefill job has its result"
        self.replies.send(job.frontend, job.result)

    def tick(self) -> bool:
        self._send_keepalives(time.monotonic())
        return self._start_compiled()

    def _send_keepalives(self, now_s: float) -> None:
        """Tell decode, for each held job not heard of for `keepalive_interval_s`, that prefill still
        holds it. Best effort: a decode not connected now gets the next one (or expires the job's
        reservation, which is what its deadline is for)."""
        held = [*self._jobs.values(), *(item[0] for item in self._compiling.items())]
        for job in held:
            if now_s - job.keepalive_s >= self.keepalive_interval_s and job.result is None:
                job.keepalive_s = now_s
                msg = job.msg
                keepalive = TransferKeepaliveMsg(msg.transfer_id, msg.request_id, msg.tenant, self.instance_id)
                try:
                    self._decode_link(job).send_if_connected(keepalive)
                except TransportError as exc:
                    logger.debug("no keepalive for transfer %s: %s", msg.transfer_id, exc)

    def _decode_link(self, job: Job) -> PeerLink:
        return self.links.get(job.msg.decode_address, job.msg.decode_public_key)

    def abort_frontend(self, frontend: bytes, reason: str) -> int:
        """End the jobs of a gone frontend, compiling or computing: decode is told to release
        each one's reservation, and the frontend (if it still listens) that the job failed."""
        compiling = self._compiling.cancel_matching(lambda item: item[0].frontend == frontend)
        self._refuse_compiling(compiling, reason)
        computing = [rid for rid, job in self._jobs.items() if job.frontend == frontend]
        outputs = [out for out in (self.engine.abort(rid, reason) for rid in computing) if out is not None]
        self.on_outputs(outputs)
        return len(compiling) + len(outputs)

    def abort_all(self, reason: str, error_code: str | None = None) -> None:
        self._refuse_compiling(self._compiling.cancel_all(), reason, error_code)
        self.on_outputs(abort_every(self.engine, reason, error_code))

    def _refuse_compiling(self, cancelled: list[tuple[str, tuple[Job, list[int], SamplingParams, int]]],
                          reason: str, error_code: str | None = None) -> None:
        """Each job whose grammar wait was cancelled fails, and decode is told to release it."""
        for _, (job, _, _, _) in cancelled:
            if error_code == ENGINE_UNAVAILABLE:
                self._refuse(job, ENGINE_UNAVAILABLE, reason, None, 503)
            else:
                self._refuse(job, REQUEST_ABORTED, f"prefill did not complete the request: {reason}", None, 500)
            self._report(job)
