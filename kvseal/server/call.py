"""One generation request from arrival to its single terminal state.

The call owns the tenant's concurrency slot and the request's audit record. `_finish` runs
exactly once, whichever comes first: a refusal at the front door, the engine's terminal
report, or the engine's death. An admitted request the engine ends early is recorded as
aborted or error, never as finished (I6).

No success without its audit line (I8): `_finish` writes the record when the engine reports
the end, before the HTTP side sees that report. If the line cannot be written the call is
`is_withheld`: a JSON answer becomes 503 `audit_unavailable`, a stream ends with that error
event instead of finishing normally.

The slot is given back only when both sides are done: the engine has reported the request's
end (its pages are free) and the HTTP response is complete (or its client gone). So a tenant
never has more requests open, on either side, than its limit.
"""

from __future__ import annotations

import logging
import time

from kvseal.engine_api import EngineGone, IsolationBreach, RequestEvent, isolation_failure
from kvseal.messages.msgs import (
    ABORT_CHOICE_FAILED,
    ABORT_CLIENT_DISCONNECTED,
    ABORT_SERVER_SHUTDOWN,
    AddRequestMsg,
    RequestOutputMsg,
    RequestRejectedMsg,
    SamplingParamsMsg,
)
from kvseal.server.audit import AuditRecord, Outcome, RejectedBy, clip, clip_optional
from kvseal.server.auth import ApiKey, Tenant
from kvseal.server.choices import ChoiceGroup, choice_msgs
from kvseal.server.endpoint import AuditPrompt
from kvseal.server.errors import REQUEST_ID_HEADER, ApiError
from kvseal.server.state import AppState
from kvseal.server.vllm_metrics import RequestSizes
from kvseal.types import ENGINE_UNAVAILABLE, HANDOFF_FAILED, NO_TOKEN_SATISFIES_CONSTRAINTS

logger = logging.getLogger("kvseal.server")


class Call:
    def __init__(self, state: AppState, endpoint: str, request_id: str) -> None:
        self.state = state
        self.endpoint = endpoint
        self.request_id = request_id
        self.tenant: Tenant | None = None
        self.key_id: str | None = None  # with --api-keys: the audit log's name for the caller's key
        self.key_digest = b""
        self.stopped_by: str | None = None  # why the operator ended it (`stop`), for a call not yet submitted
        self.model: str | None = None
        self.user: str | None = None
        self.prompt_for_audit: AuditPrompt | None = None
        self.num_prompt_tokens: int | None = None
        self.engine_ids: list[str] = []  # one engine request per choice
        self.features: list[str] | None = None  # names of the optional fields the request used
        self.is_done = False
        self._is_audited = False
        self._is_http_done = False
        self._num_slots = 0  # taken against the tenant's concurrency limit
        self._rates_taken = (0, 0)  # (requests, prompt tokens) taken from the tenant's per-minute limits
        self._aborted_for: str | None = None  # the reason of the first abort sent to the engine for it
        self._is_submitted = False
        self._received_at = time.time()
        self._received_s = time.monotonic()
        self._first_token_at: float | None = None
        self._last_token_s: float | None = None
        self._group: ChoiceGroup | None = None  # its choices, once submitted
        self._params: SamplingParamsMsg | None = None  # its first prompt's, once submitted (vLLM's n, max_tokens)
        self._route: dict[str, str] = {}  # PD mode: the engines and transfer id (filled in as it is routed)

    @property
    def is_withheld(self) -> bool:
        """The call ended but its audit line could not be written: its answer must not be sent."""
        return self.is_done and not self._is_audited

    def authenticated(self, key: ApiKey) -> None:
        """The request's key is known: from now on the operator can stop it (`stop`)."""
        self.tenant, self.key_digest = key.tenant, key.digest
        self.key_id = key.key_id if key.digest else None  # the open server's one key has no digest
        self.state.live_calls[self.request_id] = self

    def stop(self, reason: str) -> None:
        """End the request for the operator (key revoked, model disabled): a call not yet
        submitted is refused by the pipeline right before it would be, a submitted one aborted."""
        self.stopped_by = reason
        self.abort(reason)

    def take_current_limits(self) -> Tenant:
        """The call's tenant with the limits the key table gives it now, from here on: a reload
        that came while the body was arriving changed them at once, for this request too (its
        concurrency, `max_tokens` and per-minute limits are judged by the new ones)."""
        assert self.tenant is not None, "an authenticated call"
        self.tenant = self.state.keys.current(self.tenant)
        return self.tenant

    def take_slots(self, tenant: Tenant, num_choices: int) -> None:
        """Count against the tenant's concurrency limit, one slot per choice (raises `ApiError` 429)."""
        self.state.gate.acquire(tenant, num_choices)
        self._num_slots = num_choices

    def take_request(self) -> None:
        """Count the request against the tenant's requests per minute (raises `ApiError` 429)."""
        assert self.tenant is not None, "an authenticated call"
        self.state.rates.take_request(self.state.keys.current(self.tenant))
        self._rates_taken = (1, 0)

    def take_prompt_tokens(self) -> None:
        """Count its prompts' tokens against the tenant's tokens per minute (raises `ApiError` 429)."""
        assert self.tenant is not None and self.num_prompt_tokens is not None, "an authenticated, tokenized call"
        self.state.rates.take_prompt_tokens(self.state.keys.current(self.tenant), self.num_prompt_tokens)
        self._rates_taken = (self._rates_taken[0], self.num_prompt_tokens)

    def submit(self, prompts: list[AddRequestMsg]) -> ChoiceGroup:
        """Submit one engine request per choice (`n` per prompt); the group reports to this call."""
        msgs = choice_msgs(prompts)
        group = ChoiceGroup(self.request_id, [len(msg.prompt_token_ids) for msg in msgs], self,
                            choices_per_prompt=prompts[0].params.n)
        try:
            for index, choice in enumerate(msgs):
                handle = self.state.engine.submit(choice, group.observer_for(index))
                self.engine_ids.append(choice.request_id)
                if index == 0:
                    self._route = handle.route  # the first choice's engines (and PD transfer id), for the audit
        except BaseException:  # the engine went away mid-way: the choices it took end too
            assert self.tenant is not None, "a submitted call is authenticated"
            for engine_id in self.engine_ids:
                self.state.engine.abort(engine_id, self.tenant.name, ENGINE_UNAVAILABLE)
            raise
        self._is_submitted = True
        self._group = group
        self._params = prompts[0].params
        return group

    def rate_headers(self) -> dict[str, str]:
        """The tenant's x-ratelimit-* headers as they stand now (none before authentication)."""
        return self.state.rates.headers(self.state.keys.current(self.tenant)) if self.tenant is not None else {}

    def response_headers(self) -> dict[str, str]:
        """The headers of a successful answer: the request id and the tenant's rate limits."""
        return {REQUEST_ID_HEADER: self.request_id} | self.rate_headers()

    def http_done(self) -> None:
        """The HTTP side is finished: the response was sent, failed, or its client is gone."""
        self._is_http_done = True
        self._release_slot()

    def abort(self, reason: str) -> None:
        """End the request in the engine if it is still live there; a no-op otherwise. Once one of
        its choices has failed, the response ends with that failure whoever asks: the choices
        still running are aborted as its consequence (`ABORT_CHOICE_FAILED`), and the request's
        end stays the failure's, never the client's leaving (its quota and audit follow it)."""
        if self._is_submitted and not self.is_done and self.tenant is not None:
            assert self._group is not None, "a submitted call has its choices"
            if self._group.has_failed:
                reason = ABORT_CHOICE_FAILED
            else:
                self._aborted_for = self._aborted_for or reason
            for engine_id in self.engine_ids:
                self.state.engine.abort(engine_id, self.tenant.name, reason)

    def abort_on_exit(self) -> None:
        """For cleanup paths: the HTTP side is gone before the request finished."""
        self.abort(ABORT_SERVER_SHUTDOWN if self.state.is_draining else ABORT_CLIENT_DISCONNECTED)

    # ---- observer of the engine request (called by the engine client's router) ----

    def on_output(self, out: RequestOutputMsg) -> None:
        if not out.new_token_ids:
            return
        now_s = time.monotonic()
        if self._last_token_s is None:
            self._first_token_at = time.time()
            self.state.metrics.record_first_token(now_s - self._received_s)
        else:
            self.state.metrics.record_inter_token(now_s - self._last_token_s)
        self._last_token_s = now_s

    def on_terminal(self, event: RequestEvent) -> None:
        breach = isolation_failure(event)
        if breach is not None:
            self._isolation_violation(breach, event if isinstance(event, RequestOutputMsg) else self._progress())
        elif isinstance(event, IsolationBreach):
            raise AssertionError("isolation_failure() names every IsolationBreach")
        elif isinstance(event, RequestRejectedMsg) and event.http_status >= 500 and self._aborted_for is None:
            # the engines' own failure (a KV transfer that failed, a prefill that broke): the server's
            # error, as a refusal at the door with a 5xx is, never the request's rejection
            self._finish("error", reason=event.code, http_status=event.http_status, detail=event.message,
                         out=self._progress())
        elif isinstance(event, RequestRejectedMsg) and event.http_status >= 500:
            # an engine's answer to the abort asked for it (PD prefill refuses what it was told to
            # abort with a 500): the end is that abort's, as for every other engine's end after it
            self._finish("aborted", reason=self._aborted_for, detail=event.message, out=self._progress())
        elif isinstance(event, RequestRejectedMsg):
            self._finish("rejected", reason=event.code, http_status=event.http_status, rejected_by="engine",
                         out=self._progress())
        elif isinstance(event, EngineGone):
            # a code, as for the requests refused at the door meanwhile: `kvseal audit --reason` finds them all
            self._finish("error", reason=ENGINE_UNAVAILABLE, detail=event.message, out=self._progress())
        elif event.finish_reason == "abort" and event.error_code == NO_TOKEN_SATISFIES_CONSTRAINTS:
            # the request's own constraints (a 400): audited by its code, as a PD prefill's refusal
            # of the first token is, so `kvseal audit --reason` finds both
            self._finish("aborted", reason=event.error_code, http_status=400, detail=event.error, out=event)
        elif event.finish_reason == "abort" and event.error_code == HANDOFF_FAILED and self._aborted_for is None:
            # PD decode ended it (no sign of its prefill in time): the server's failure, by its code
            self._finish("error", reason=HANDOFF_FAILED, http_status=503, detail=event.error, out=event)
        elif event.finish_reason == "abort":
            reason, detail = self._abort_reason(event)
            self._finish("aborted", reason=reason, detail=detail, out=event)
        else:
            self._finish("finished", out=event)
        if self._failed_before_any_token(event):  # last: the request is audited and its slot free
            self._give_back_rates()

    def _abort_reason(self, event: RequestOutputMsg) -> tuple[str | None, str | None]:
        """The audit's reason (a code) for an engine's aborted end: the abort this call asked for,
        whatever words the engine ended it with (PD decode may end it with a later abort's, or with
        its own expiry's sentence, once KV stopped landing), those words then kept as the detail;
        without one, the engine's own reason (`frontend_gone`, `server_shutdown`, ...)."""
        if self._aborted_for is None or event.error == self._aborted_for:
            return event.error, None
        return self._aborted_for, event.error

    def _failed_before_any_token(self, event: RequestEvent) -> bool:
        """The server's own failure ended the request before it generated a token: the engine
        lost (`EngineGone`), an engine's refusal with a 5xx (a failed transfer), a PD handoff that
        failed on decode (`kv_handoff_failed`: its prefill gave no sign in time), shutdown. A
        client's disconnect or the request's own constraints are not the server's doing: nor is
        an engine's end that follows an abort the client's leaving (or the operator) asked for,
        whatever its code (PD prefill reports its aborts as 500 `request_aborted`). Every choice
        counts: one choice's failure after another generated is no failure before any token."""
        if self._aborted_for not in (None, ABORT_SERVER_SHUTDOWN):
            return False
        is_handoff_failure = isinstance(event, RequestOutputMsg) and event.error_code == HANDOFF_FAILED
        if isinstance(event, RequestRejectedMsg | EngineGone) or is_handoff_failure:
            if isinstance(event, RequestRejectedMsg) and event.http_status < 500:
                return False
            progress = self._progress()
            return progress is None or progress.num_output_tokens == 0
        return (isinstance(event, RequestOutputMsg) and event.finish_reason == "abort"
                and event.error == ABORT_SERVER_SHUTDOWN and event.num_output_tokens == 0)

    def _progress(self) -> RequestOutputMsg | None:
        """What every choice has generated so far, for a request the engine loses."""
        return self._group.progress() if self._group is not None else None

    def _isolation_violation(self, reason: str, out: RequestOutputMsg | None) -> None:
        """An isolation check tripped: 500 to the client, counted, audited and logged as an incident."""
        tenant = self.tenant.name if self.tenant is not None else ""
        logger.error("ISOLATION VIOLATION: request %s of tenant '%s' was failed closed: %s", self.request_id,
                     clip(tenant), clip(reason))
        self.state.metrics.isolation_violations.inc()
        self._finish("isolation_violation", reason=reason, http_status=500, out=out)

    # ---- refusals before or instead of generation ----

    def abandon(self, reason: str) -> None:
        """The client left before the request reached the engine."""
        self._finish("aborted", reason=reason)
        self.http_done()

    def reject(self, err: ApiError) -> None:
        """A refusal answered with `err`; this also ends the HTTP side. A refusal that is the
        server's doing (5xx: the engine restarting, the audit log down, shutdown) gives back the
        per-minute requests and tokens it took: nothing ran, and a client retrying it is not
        charged twice."""
        self._finish("rejected" if err.status < 500 else "error", reason=err.reason, http_status=err.status,
                     rejected_by="frontend" if err.status < 500 else None)
        self.http_done()
        if err.status >= 500:  # last: whatever giving back raises, the refusal is already audited and its slot free
            self._give_back_rates()

    def _give_back_rates(self) -> None:
        """The server's own failure ended the request before it generated a token (a 5xx: the
        engine lost or restarting, shutdown, the audit log down): the per-minute request and
        prompt tokens it took go back, so a client retrying it is not charged for what never ran.
        Called after `_finish`, so the refusal is audited and its slot free whatever this raises."""
        if self.tenant is not None:
            taken, self._rates_taken = self._rates_taken, (0, 0)
            self.state.rates.give_back(self.state.keys.current(self.tenant), *taken)

    def _finish(self, outcome: Outcome, *, reason: str | None = None, http_status: int | None = None,
                out: RequestOutputMsg | None = None, rejected_by: RejectedBy | None = None,
                detail: str | None = None) -> None:
        if self.is_done:
            return
        self.is_done = True
        self.state.live_calls.pop(self.request_id, None)
        self._release_slot()
        try:
            self._count(outcome, reason, out)
        finally:  # the record is written whatever counting raised: one line per request (I8)
            self._is_audited = self.state.audit.write(self._record(outcome, reason, http_status, out, rejected_by,
                                                                      detail))

    def _count(self, outcome: Outcome, reason: str | None, out: RequestOutputMsg | None) -> None:
        """The metrics of the ended call, and its completion tokens against the tenant's tokens per minute."""
        tenant = self.tenant.name if self.tenant is not None else ""
        self.state.metrics.record_outcome(tenant, outcome, reason if outcome == "rejected" else None)
        if out is not None and outcome in ("finished", "aborted") and out.finish_reason is not None:
            # vLLM's request_success, e2e latency and per-request histograms: requests its engine ended, aborts included
            self.state.metrics.record_finished(out.finish_reason, time.monotonic() - self._received_s)
            self._count_request(out)
        if out is not None:
            self.state.metrics.record_prefix_cache(tenant, out.num_prompt_tokens, out.num_cached_tokens)
            self.state.metrics.record_usage(tenant, out.num_prompt_tokens, out.num_output_tokens,
                                            out.num_cached_tokens)
            if self.tenant is not None:  # its prompt tokens were counted when it was submitted
                self.state.rates.charge_tokens(self.state.keys.current(self.tenant), out.num_output_tokens)

    def _count_request(self, out: RequestOutputMsg) -> None:
        """vLLM's per-request sizes and phases of a request its engine ended."""
        assert self._group is not None and self._params is not None, "the engine ends only submitted requests"
        sizes = RequestSizes(num_prompt_tokens=out.num_prompt_tokens, num_generation_tokens=out.num_output_tokens,
                             max_num_generation_tokens=self._group.max_num_output_tokens(), n=self._params.n,
                             max_tokens=self._params.max_tokens)
        self.state.metrics.vllm.record_request(sizes, out.timing)

    def _release_slot(self) -> None:
        if self._num_slots and self.is_done and self._is_http_done and self.tenant is not None:
            self.state.gate.release(self.tenant, self._num_slots)
            self._num_slots = 0

    def _record(self, outcome: Outcome, reason: str | None, http_status: int | None,
                out: RequestOutputMsg | None, rejected_by: RejectedBy | None, detail: str | None) -> AuditRecord:
        return AuditRecord(
            request_id=self.request_id, endpoint=self.endpoint,
            tenant=self.tenant.name if self.tenant is not None else None, outcome=outcome,
            http_status=http_status, received_at=self._received_at, finished_at=time.time(),
            model=clip_optional(self.model), reason=clip_optional(reason), detail=clip_optional(detail),
            rejected_by=rejected_by,
            finish_reason=out.finish_reason if out is not None else None,
            prompt_tokens=out.num_prompt_tokens if out is not None else self.num_prompt_tokens,
            output_tokens=out.num_output_tokens if out is not None else None,
            pages_reserved=out.num_pages_reserved if out is not None else None,
            kv_tokens_written=out.num_kv_tokens_written if out is not None else None,
            cached_tokens=out.num_cached_tokens if out is not None else None,
            first_token_at=self._first_token_at, user=clip_optional(self.user), key_id=self.key_id,
            features=self.features,
            engine=self._route.get("engine"), prefill_engine=self._route.get("prefill_engine"),
            decode_engine=self._route.get("decode_engine"),
            transfer_id=self._route.get("transfer_id"),
            prompt=self.prompt_for_audit if self.state.audit.include_prompts else None,
        )
