"""The frontend's receive side fails closed, in-process with real parts (no engine process):
crafted engine messages go through the real codec, `EngineClient` routing, `Call`, audit log
and metrics.

- An output naming another tenant than its request's never reaches the client: the request
  ends with `isolation_check_failed`, counted and audited as an isolation violation, and is
  aborted in the engine.
- An exception while routing, auditing or counting fails every in-flight request with an
  error, makes the client unavailable (/health 503) and is logged at CRITICAL.
- An audit log that cannot be written is not such an exception: routing goes on, the request
  whose line failed is withheld, and the engine stays available.
- What reaches the engine is what is counted: every choice's tokens when the engine is lost, no
  per-minute quota for a request the server refused itself, no request for a key a reload took.
- A reload while a request's body comes in applies its limits to that request, and the tenant
  as the request first saw it never resets the tenant's per-minute buckets.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from starlette.testclient import TestClient
from tiny_models import make_tokenizer

from kvseal.config import EngineArgs
from kvseal.engine.client import EngineClient
from kvseal.engine_api import EngineGone, EngineUnavailable, IsolationBreach, RequestEvent
from kvseal.messages.codec import encode
from kvseal.messages.convert import params_to_msg
from kvseal.messages.msgs import (
    TP_RANK_LOST,
    AbortMsg,
    AddRequestMsg,
    EngineFailedMsg,
    EngineReadyMsg,
    EngineStatsMsg,
    OutputsMsg,
    RequestOutputMsg,
    RequestRejectedMsg,
)
from kvseal.server import errors
from kvseal.server.admin import reload_keys
from kvseal.server.app import build_app
from kvseal.server.audit import AuditLog
from kvseal.server.auth import ApiKeyTable, Tenant
from kvseal.server.call import Call
from kvseal.server.choices import ChoiceEvent, ChoiceGroup
from kvseal.server.config import ServerConfig
from kvseal.server.metrics import ServerMetrics
from kvseal.server.prompts import PromptEncoder
from kvseal.server.rate_limits import RateLimits
from kvseal.server.state import AppState
from kvseal.types import (
    HANDOFF_FAILED,
    ISOLATION_CHECK_FAILED,
    NO_TOKEN_LEFT_GRAMMAR,
    NO_TOKEN_SATISFIES_CONSTRAINTS,
    SamplingParams,
)

READY = EngineReadyMsg(pid=1, model_name="tiny", model_path="/m", tokenizer_path="/m", architecture="llama",
                       max_model_len=64, kv_cache_tokens=256, vocab_size=512, page_size=4, num_pages=64,
                       kv_scrub_policy="off")
ALICE = Tenant("alice")


async def _ready_state(tmp_path: Path, keys: ApiKeyTable | None = None) -> AppState:
    """An AppState around an EngineClient whose engine has 'said ready' (no process started)."""
    metrics = ServerMetrics()
    engine = EngineClient(EngineArgs(), "INFO")
    engine.on_stats = metrics.record_stats
    engine._ready = asyncio.get_running_loop().create_future()
    engine._ready.set_result(READY)
    return AppState(ServerConfig(), engine, READY, PromptEncoder(make_tokenizer()), keys or ApiKeyTable(), metrics,
                    AuditLog(str(tmp_path / "audit.jsonl"), include_prompts=False))


def _close(state: AppState) -> None:
    state.engine._push.close(linger=0)
    state.engine._pull.close(linger=0)
    state.engine._process.cleanup()
    state.audit.close()


def _submit(state: AppState, request_id: str) -> ChoiceGroup:
    return _submitted(state, request_id)[1]


def _submitted(state: AppState, request_id: str) -> tuple[Call, ChoiceGroup]:
    call = Call(state, "/v1/completions", request_id)
    call.tenant = ALICE
    call.take_slots(ALICE, 1)
    call.http_done()
    params = params_to_msg(SamplingParams(max_tokens=4))
    return call, call.submit([AddRequestMsg(request_id, ALICE.name, [5, 6], params)])


def _output(request_id: str, tenant: str, finished: bool) -> RequestOutputMsg:
    return RequestOutputMsg(request_id=request_id, tenant=tenant, new_token_ids=[7], new_text=" w7", finished=finished,
                            finish_reason="length" if finished else None, stop_reason=None, num_prompt_tokens=2,
                            num_output_tokens=1, num_pages_reserved=1)


async def _events(group: ChoiceGroup) -> list[RequestEvent]:
    """The events of a one-choice request, as its response reads them."""
    async def collect(events: AsyncIterator[ChoiceEvent]) -> list[RequestEvent]:
        return [event async for _, event in events]

    return await asyncio.wait_for(collect(group.events()), timeout=10)


def _audit(tmp_path: Path) -> dict[str, dict]:
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    return {r["request_id"]: r for r in map(json.loads, lines)}


def test_an_output_naming_another_tenant_fails_its_request_closed(tmp_path: Path) -> None:
    async def scenario() -> None:
        state = await _ready_state(tmp_path)
        try:
            handle = _submit(state, "cmpl-1")
            bystander = _submit(state, "cmpl-2")
            state.engine._receive(encode(OutputsMsg([_output("cmpl-1", "bob", finished=False)])))
            events = await _events(handle)
            assert len(events) == 1 and isinstance(events[0], IsolationBreach)
            err = errors.for_event(events[0])
            assert err is not None and (err.status, err.code) == (500, "isolation_check_failed")
            assert "w7" not in err.message  # the foreign output never reaches the client
            record = _audit(tmp_path)["cmpl-1"]
            assert record["outcome"] == "isolation_violation" and "tenant 'bob'" in record["reason"]
            assert state.metrics.isolation_violations._value.get() == 1
            sent = [state.engine._outbox.get_nowait() for _ in range(state.engine._outbox.qsize())]
            assert AbortMsg("cmpl-1", "alice", "isolation_check_failed") in sent
            # The engine and other requests go on.
            assert state.engine.is_available and state.engine.num_in_flight == 1
            state.engine._receive(encode(OutputsMsg([_output("cmpl-2", "alice", finished=True)])))
            assert [type(e) for e in await _events(bystander)] == [RequestOutputMsg]
        finally:
            _close(state)

    asyncio.run(scenario())


def test_a_failure_while_routing_fails_every_request_and_health(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> AppState:
        state = await _ready_state(tmp_path)
        engine = state.engine
        first, second = _submit(state, "cmpl-1"), _submit(state, "cmpl-2")
        engine._pull.bind(engine._process.addresses.from_engine)
        receiving = asyncio.create_task(engine._receive_loop())
        state.metrics.ttft = None  # type: ignore[assignment]  # counting now raises (a frontend bug)
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(engine._process.addresses.from_engine)
        try:
            push.send(encode(OutputsMsg([_output("cmpl-1", "alice", finished=False)])))
            push.send(encode(OutputsMsg([_output("cmpl-1", "alice", finished=True)])))
            await asyncio.wait_for(receiving, timeout=10)  # the loop ends, loudly, instead of dying silently
            assert isinstance((await _events(first))[-1], RequestOutputMsg | EngineGone)
            assert [type(e) for e in await _events(second)] == [EngineGone]
            assert not engine.is_available and engine.failure and "routing engine outputs" in engine.failure
            assert engine.num_in_flight == 0
        finally:
            push.close(linger=0)
            _close(state)
        return state

    with caplog.at_level(logging.CRITICAL, logger="kvseal.server"):
        state = asyncio.run(scenario())
    assert any(r.levelno == logging.CRITICAL and "receive loop failed" in r.message for r in caplog.records)
    with TestClient(build_app(state)) as client:
        health = client.get("/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_unavailable"


def test_a_failed_engine_loop_reaches_clients_without_its_exception_type(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    """The engine's `EngineFailedMsg` (a tensor-parallel rank lost) fails its requests and /health
    with the engine's plain reason; the exception's class name is the log's, not the clients'."""
    async def scenario() -> tuple[AppState, list[RequestEvent]]:
        state = await _ready_state(tmp_path)
        group = _submit(state, "cmpl-1")
        state.engine._receive(encode(EngineFailedMsg("RankFailure", TP_RANK_LOST)))
        return state, await _events(group)

    with caplog.at_level(logging.ERROR, logger="kvseal.server"):
        state, events = asyncio.run(scenario())
    try:
        assert events == [EngineGone(TP_RANK_LOST)] and state.engine.failure == TP_RANK_LOST
        assert any(f"RankFailure: {TP_RANK_LOST}" in r.message for r in caplog.records)
    finally:
        _close(state)


def test_a_failing_audit_log_never_reaches_the_receive_loop(tmp_path: Path) -> None:
    async def scenario() -> None:
        state = await _ready_state(tmp_path)
        try:
            (tmp_path / "audit.jsonl").unlink()
            (tmp_path / "audit.jsonl").symlink_to("/dev/full")  # a full disk: every write fails (ENOSPC)
            calls = [Call(state, "/v1/completions", f"cmpl-{i}") for i in (1, 2)]
            for call in calls:
                call.tenant = ALICE
                params = params_to_msg(SamplingParams(max_tokens=4))
                call.submit([AddRequestMsg(call.request_id, ALICE.name, [5, 6], params)])
            state.engine._receive(encode(OutputsMsg([_output("cmpl-1", "alice", finished=True)])))
            state.engine._receive(encode(OutputsMsg([_output("cmpl-2", "alice", finished=True)])))
            assert all(call.is_done and call.is_withheld for call in calls)
            assert state.engine.is_available and state.engine.failure is None and state.engine.num_in_flight == 0
            assert state.audit.failure is not None and "No space left on device" in state.audit.failure
            assert state.audit.stats.num_pending == 2
        finally:
            _close(state)

    asyncio.run(scenario())


@pytest.mark.parametrize("status", [200, 302, 0, 700])
def test_an_engine_refusal_with_a_status_that_is_no_error_is_a_500(status: int) -> None:
    """A PD decode engine relays prefill's refusal, status and all: a broken or hostile peer's
    success status must not turn a refusal into a 200 (I6)."""
    err = errors.for_event(RequestRejectedMsg("cmpl-1", "alice", "prefill_refused", "no", None, status))
    assert err is not None and err.status == 500 and err.code == "prefill_refused"
    kept = errors.for_event(RequestRejectedMsg("cmpl-1", "alice", "context_length_exceeded", "long", "prompt", 400))
    assert kept is not None and kept.status == 400


def test_a_request_its_own_constraints_left_no_token_is_a_400_naming_why() -> None:
    """The engine ends a request whose grammar and allowed_token_ids share no token: the client's
    constraints, so a 400 with the engine's code and message (an error event once streaming),
    not the 500 of a request the server aborted."""
    out = RequestOutputMsg("cmpl-1", "alice", [], "", True, "abort", None, 3, 0, 1,
                           error="no token satisfies both", error_code=NO_TOKEN_SATISFIES_CONSTRAINTS)
    err = errors.for_event(out)
    assert err is not None and (err.status, err.code, err.param, err.message) == (
        400, NO_TOKEN_SATISFIES_CONSTRAINTS, "allowed_token_ids", "no token satisfies both")
    grammar_alone = msgspec.structs.replace(out, error=NO_TOKEN_LEFT_GRAMMAR)  # the vocabulary cannot continue it
    err = errors.for_event(grammar_alone)
    assert err is not None and (err.status, err.param, err.message) == (400, None, NO_TOKEN_LEFT_GRAMMAR)


def test_an_engine_lost_midway_through_a_submit_ends_the_choices_it_took(tmp_path: Path) -> None:
    """Several prompts are several engine requests: if the engine goes away after taking some,
    those are aborted before the refusal propagates, so none runs on for nobody."""
    state = asyncio.run(_ready_state(tmp_path))
    try:
        engine = state.engine
        taken: list[str] = []
        aborted: list[tuple[str, str]] = []
        real_submit = engine.submit

        def submit(msg: AddRequestMsg, observer: Any) -> Any:
            if taken:
                raise EngineUnavailable("the engine died")
            taken.append(msg.request_id)
            return real_submit(msg, observer)

        engine.submit = submit  # type: ignore[method-assign]
        engine.abort = lambda request_id, tenant, reason: aborted.append((request_id, reason))  # type: ignore
        call = Call(state, "/v1/completions", "r-lost")
        call.tenant = ALICE
        params = params_to_msg(SamplingParams(max_tokens=4))
        with pytest.raises(EngineUnavailable):
            call.submit([AddRequestMsg("r-lost", ALICE.name, [5, 6], params),
                         AddRequestMsg("r-lost", ALICE.name, [7, 8], params)])
        assert taken == ["r-lost-0"] and aborted == [("r-lost-0", "engine_unavailable")]
    finally:
        _close(state)


@pytest.mark.parametrize(("with_output", "expected"), [([0, 1, 2], (12, 6, 2)), ([1, 2], (7, 5, 2))])
def test_an_engine_lost_under_n_choices_counts_every_choices_tokens(tmp_path: Path, with_output: list[int],
                                                                    expected: tuple[int, int, int]) -> None:
    """The audit record (and the usage counters and the tokens-per-minute charge that follow it)
    of an `n` > 1 request the engine loses counts what every choice generated, not choice 0's,
    and its prompt whichever choices had output."""
    async def scenario() -> None:
        state = await _ready_state(tmp_path)
        try:
            call = Call(state, "/v1/completions", "r-n3")
            call.tenant = ALICE
            call.take_slots(ALICE, 3)
            call.http_done()
            params = params_to_msg(SamplingParams(max_tokens=40, n=3))
            group = call.submit([AddRequestMsg("r-n3", ALICE.name, [5, 6], params)])
            for index, num_tokens in [(i, [5, 4, 3][i]) for i in with_output]:
                out = msgspec.structs.replace(_output(f"r-n3-{index}", "alice", finished=False),
                                              num_output_tokens=num_tokens, num_pages_reserved=index + 1)
                state.engine._receive(encode(OutputsMsg([out])))
            state.engine._fail_handles("the engine died")
            assert isinstance((await _events(group))[-1], EngineGone)
            record = _audit(tmp_path)["r-n3"]
            assert record["outcome"] == "error" and record["reason"] == "engine_unavailable"
            assert (record["output_tokens"], record["pages_reserved"], record["prompt_tokens"]) == expected
        finally:
            _close(state)

    asyncio.run(scenario())


def _handoff_failed(request_id: str, error: str = "no sign of the prefill engine for 30 s") -> RequestOutputMsg:
    """PD decode's end of a request whose reservation expired (or was released) before its commit."""
    return RequestOutputMsg(request_id=request_id, tenant="alice", new_token_ids=[], new_text="", finished=True,
                            finish_reason="abort", stop_reason=None, num_prompt_tokens=2, num_output_tokens=0,
                            num_pages_reserved=1, error=error, error_code=HANDOFF_FAILED)


def test_a_failed_pd_handoff_is_the_servers_error_with_its_code(tmp_path: Path) -> None:
    """Decode's end of a request whose handoff failed (its prefill gave no sign in time) is the
    server's failure: 503 `kv_handoff_failed` to the client, audited as `error` with that reason
    (never `aborted`, the outcome of a client that left)."""
    async def scenario() -> tuple[list[RequestEvent], Path]:
        state = await _ready_state(tmp_path)
        try:
            group = _submit(state, "r-h")
            state.engine._receive(encode(OutputsMsg([_handoff_failed("r-h")])))
            return await _events(group), tmp_path
        finally:
            _close(state)

    events, _ = asyncio.run(scenario())
    error = errors.for_event(events[-1])
    assert error is not None and (error.status, error.code) == (503, HANDOFF_FAILED), error
    record = _audit(tmp_path)["r-h"]
    assert (record["outcome"], record["reason"], record["http_status"]) == ("error", HANDOFF_FAILED, 503), record
    assert record["detail"] == "no sign of the prefill engine for 30 s"


@pytest.mark.parametrize(("status", "outcome", "error_type"), [(502, "error", "server_error"),
                                                               (503, "error", "service_unavailable"),
                                                               (400, "rejected", "invalid_request_error")])
def test_an_engines_refusal_with_a_5xx_is_the_servers_error(tmp_path: Path, status: int, outcome: str,
                                                            error_type: str) -> None:
    """An engine's refusal is the request's rejection when it is a 4xx (its own limits), and the
    server's error when it is a 5xx (a KV transfer that failed): audited as the refusals at the
    door are, with the engine's words as the detail of an error."""
    async def scenario() -> list[RequestEvent]:
        state = await _ready_state(tmp_path)
        try:
            group = _submit(state, "r-x")
            state.engine._receive(encode(RequestRejectedMsg("r-x", "alice", "kv_transfer_failed", "the push failed",
                                                            None, status)))
            return await _events(group)
        finally:
            _close(state)

    events = asyncio.run(scenario())
    error = errors.for_event(events[-1])
    assert error is not None and (error.status, error.body()["error"]["type"]) == (status, error_type), error
    record = _audit(tmp_path)["r-x"]
    assert (record["outcome"], record["reason"], record["http_status"]) == (outcome, "kv_transfer_failed", status)
    assert record.get("rejected_by") == (None if status >= 500 else "engine"), record
    assert record.get("detail") == ("the push failed" if status >= 500 else None), record


def test_an_engines_5xx_after_the_clients_abort_is_that_abort(tmp_path: Path) -> None:
    """PD prefill answers the abort a client's leaving caused with a 500 refusal, which decode may
    relay before its own end: the request is audited as the client's abort, not the server's error."""
    async def scenario() -> None:
        state = await _ready_state(tmp_path)
        try:
            call, group = _submitted(state, "r-g")
            call.abort_on_exit()  # the client left
            state.engine._receive(encode(RequestRejectedMsg("r-g", "alice", "request_aborted", "prefill did not "
                                                            "complete the request: client_disconnected", None, 500)))
            await _events(group)
        finally:
            _close(state)

    asyncio.run(scenario())
    record = _audit(tmp_path)["r-g"]
    assert (record["outcome"], record["reason"]) == ("aborted", "client_disconnected"), record


@pytest.mark.parametrize(("error", "error_code"), [
    ("the request ended before its reservation", None),  # a later abort's words (PD decode, before the fix)
    ("no sign of the prefill engine for 30 s", HANDOFF_FAILED),  # decode's expiry, racing the client's abort
])
def test_an_engines_end_after_the_clients_abort_is_audited_as_that_abort(tmp_path: Path, error: str,
                                                                         error_code: str | None) -> None:
    """The client left and the engine ended the request in other words than the abort's: the audit's
    reason is the abort's code (`kvseal audit --reason client_disconnected` finds it), never a
    sentence; the engine's words are the detail."""
    async def scenario() -> None:
        state = await _ready_state(tmp_path)
        try:
            call, group = _submitted(state, "r-w")
            call.abort_on_exit()  # the client left
            ended = msgspec.structs.replace(_handoff_failed("r-w", error), error_code=error_code)
            state.engine._receive(encode(OutputsMsg([ended])))
            await _events(group)
        finally:
            _close(state)

    asyncio.run(scenario())
    record = _audit(tmp_path)["r-w"]
    assert (record["outcome"], record["reason"], record["detail"]) == ("aborted", "client_disconnected", error)


def test_an_operators_abort_that_decode_ends_late_is_still_the_operators() -> None:
    """Decode reports an abort it could only finish once KV stopped landing with the handoff's
    code; the client still hears what stopped it (the operator's revocation, shutdown)."""
    revoked = errors.for_event(_handoff_failed("r", "api_key_revoked"))
    down = errors.for_event(_handoff_failed("r", "server_shutdown"))
    assert revoked is not None and revoked.code == "api_key_revoked", revoked
    assert down is not None and down.code == "engine_unavailable", down
    failed = errors.for_event(_handoff_failed("r"))
    assert failed is not None and failed.code == HANDOFF_FAILED


def _keys(tmp_path: Path, entries: dict[str, Any]) -> ApiKeyTable:
    path = tmp_path / f"keys-{len(entries)}-{sorted(entries)[0]}.json"
    path.write_text(json.dumps(entries))
    return ApiKeyTable.load(str(path))


def test_a_request_refused_while_the_engine_is_down_takes_no_per_minute_quota(tmp_path: Path) -> None:
    """A 503 is the server's doing: the requests and prompt tokens it took go back, so a client
    retrying through an engine restart is not refused 429 for requests that never ran."""
    keys = _keys(tmp_path, {"key-a": {"tenant": "alice", "requests_per_minute": 2, "tokens_per_minute": 50}})
    state = asyncio.run(_ready_state(tmp_path, keys))
    try:
        state.engine._fail("the engine died")
        with TestClient(build_app(state)) as client:
            for _ in range(3):
                response = client.post("/v1/completions", headers={"Authorization": "Bearer key-a"},
                                       json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2})
                assert response.status_code == 503, response.text
                assert response.json()["error"]["code"] == "engine_unavailable"
                assert response.headers["x-ratelimit-remaining-requests"] == "2"
                assert response.headers["x-ratelimit-remaining-tokens"] == "50"
    finally:
        _close(state)


def _lose_or_refuse(state: AppState, request_id: str, how: str) -> None:
    """End the submitted one-choice request `request_id` of alice the way `how` names."""
    if how == "refused 502":  # an engine's own failure, relayed (a PD transfer that failed)
        state.engine._receive(encode(RequestRejectedMsg(request_id, "alice", "transfer_failed", "failed", None, 502)))
    elif how == "client gone, then refused 500":  # PD prefill reports the abort it was sent as a 500
        state.engine._receive(encode(RequestRejectedMsg(request_id, "alice", "request_aborted", "aborted", None, 500)))
    elif how == "a token, then refused 502":  # one choice generated (a stream sent it), then the transfer failed
        state.engine._receive(encode(OutputsMsg([_output(request_id, "alice", finished=False)])))
        state.engine._receive(encode(RequestRejectedMsg(request_id, "alice", "transfer_failed", "failed", None, 502)))
    elif how.endswith("handoff failed"):  # PD decode ended it: no sign of its prefill within the deadline
        state.engine._receive(encode(OutputsMsg([_handoff_failed(request_id)])))
    elif how == "refused 400":  # the request's own fault, found by the engine
        state.engine._receive(encode(RequestRejectedMsg(request_id, "alice", "invalid", "too long", None, 400)))
    else:
        if how == "lost after a token":
            state.engine._receive(encode(OutputsMsg([_output(request_id, "alice", finished=False)])))
        state.engine._fail_handles("no prefill engine is reachable")  # as PD's `_on_reserved` ends it


@pytest.mark.parametrize(("how", "remaining"), [("lost before a token", ("2", "50")), ("refused 502", ("2", "50")),
                                                 ("lost after a token", ("1", "47")), ("refused 400", ("1", "48")),
                                                 ("client gone, then refused 500", ("1", "48")),
                                                 ("handoff failed", ("2", "50")),
                                                 ("client gone, then handoff failed", ("1", "48")),
                                                 ("a token, then refused 502", ("1", "47"))])
def test_a_request_the_server_fails_before_its_first_token_takes_no_per_minute_quota(
        tmp_path: Path, how: str, remaining: tuple[str, str]) -> None:
    """A request already submitted that the server's own failure ends before its first token (the
    engine lost, `serve --pd`'s prefill engine gone after decode reserved; an engine's 5xx) gets
    back the request and prompt tokens it took, as a 503 at the door does. One that generated a
    token has run (its prompt and output are charged), an engine's 4xx is the request's fault, and
    an end that follows the abort a client's leaving sent (PD prefill answers it 500
    `request_aborted`) is the client's doing: a tenant cannot send long prompts and leave for free."""
    keys = _keys(tmp_path, {"key-a": {"tenant": "alice", "requests_per_minute": 2, "tokens_per_minute": 50}})

    async def scenario() -> None:
        state = await _ready_state(tmp_path, keys)
        try:
            call = Call(state, "/v1/completions", "r-q")
            call.tenant = state.keys.current(ALICE)
            call.take_slots(call.tenant, 1)
            call.take_request()
            call.num_prompt_tokens = 2
            call.take_prompt_tokens()
            call.submit([AddRequestMsg("r-q", "alice", [5, 6], params_to_msg(SamplingParams(max_tokens=4)))])
            if how.startswith("client gone"):
                call.abort_on_exit()  # as the response does when the client leaves
            _lose_or_refuse(state, "r-q", how)
            call.http_done()
            assert call.is_done and state.gate.num_tenants_in_flight() == 0
            headers = call.rate_headers()
            assert (headers["x-ratelimit-remaining-requests"], headers["x-ratelimit-remaining-tokens"]) == remaining
        finally:
            _close(state)

    asyncio.run(scenario())


def _choice_end(request_id: str, how: str) -> bytes:
    """The engine's end of one choice of alice's three-token prompt, the way `how` names."""
    if how.startswith("aborted: "):  # the engine's answer to an abort: the reason it was sent
        return encode(OutputsMsg([msgspec.structs.replace(_handoff_failed(request_id), num_prompt_tokens=3,
                                                          error_code=None, error=how.removeprefix("aborted: "))]))
    if how == "a token, finished":
        return encode(OutputsMsg([msgspec.structs.replace(_output(request_id, "alice", finished=True),
                                                          num_prompt_tokens=3)]))
    if how == "handoff failed":
        return encode(OutputsMsg([msgspec.structs.replace(_handoff_failed(request_id), num_prompt_tokens=3)]))
    if how == "no token satisfies":  # the request's own constraints: the client's fault
        return encode(OutputsMsg([msgspec.structs.replace(
            _handoff_failed(request_id), num_prompt_tokens=3, error="no token satisfies both",
            error_code=NO_TOKEN_SATISFIES_CONSTRAINTS)]))
    assert how == "refused 502", how  # an engine's own failure (a PD transfer that failed)
    return encode(RequestRejectedMsg(request_id, "alice", "transfer_failed", "the push failed", None, 502))


async def _two_choices_one_failing(state: AppState, first: str | None, failure: str, stream: bool
                                   ) -> tuple[httpx.Response, list[AbortMsg]]:
    """POST an n=2 completion; the engine ends choice 0 as `first` says (None: it runs on), then
    fails choice 1 as `failure` says, and answers every abort the frontend then sends."""
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4, "n": 2, "stream": stream}
    transport = httpx.ASGITransport(app=build_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        posted = asyncio.create_task(client.post("/v1/completions", json=body,
                                                 headers={"Authorization": "Bearer key-a"}))
        submitted: list[str] = []
        while len(submitted) < 2:
            msg = await asyncio.wait_for(state.engine._outbox.get(), timeout=10)
            submitted += [msg.request_id] if isinstance(msg, AddRequestMsg) else []
        if first is not None:
            state.engine._receive(_choice_end(submitted[0], first))
        state.engine._receive(_choice_end(submitted[1], failure))
        response = await asyncio.wait_for(posted, timeout=10)
    aborts = [m for m in (state.engine._outbox.get_nowait() for _ in range(state.engine._outbox.qsize()))
              if isinstance(m, AbortMsg)]
    for abort in aborts:  # as the engine does: the aborted choice ends, its pages freed
        state.engine._receive(_choice_end(abort.request_id, f"aborted: {abort.reason}"))
    return response, aborts


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("first", "failure", "status", "audited", "remaining"), [
    (None, "refused 502", 502, ("error", "transfer_failed", 502, 0), ("2", "50")),
    (None, "handoff failed", 503, ("error", HANDOFF_FAILED, 503, 0), ("2", "50")),
    ("a token, finished", "refused 502", 502, ("error", "transfer_failed", 502, 1), ("1", "46")),
    (None, "no token satisfies", 400, ("aborted", NO_TOKEN_SATISFIES_CONSTRAINTS, 400, 0), ("1", "47"))])
def test_one_failing_choice_of_n_ends_the_request_as_that_failure(
        tmp_path: Path, stream: bool, first: str | None, failure: str, status: int,
        audited: tuple[str, str, int, int], remaining: tuple[str, str]) -> None:
    """A request with `n` = 2 whose choice 1 fails is answered with that failure (a stream: its error
    event, never a finish), the choice still running is aborted as the failure's consequence (not
    as a client that left), and the audit and the per-minute limits say what a one-choice request
    failing so says: the server's failure before any token gives back the request and its prompt
    tokens; what a choice generated is charged and audited; the request's own fault (a 400) is
    charged as it ran."""
    keys = _keys(tmp_path, {"key-a": {"tenant": "alice", "requests_per_minute": 2, "tokens_per_minute": 50}})

    async def scenario() -> None:
        state = await _ready_state(tmp_path, keys)
        try:
            response, aborts = await _two_choices_one_failing(state, first, failure, stream)
            sent = response.json() if not stream else json.loads(response.text.split("data: ")[-2])
            assert sent["error"]["code"] == audited[1] and response.status_code == (200 if stream else status)
            [record] = _audit(tmp_path).values()
            assert (record["outcome"], record["reason"], record.get("http_status"),
                    record.get("output_tokens")) == audited, record
            headers = state.rates.headers(state.keys.current(ALICE))
            assert (headers["x-ratelimit-remaining-requests"], headers["x-ratelimit-remaining-tokens"]) == remaining
            assert [a.reason for a in aborts] == ([] if first else ["another_choice_failed"])
            assert state.gate.num_tenants_in_flight() == 0
        finally:
            _close(state)

    asyncio.run(scenario())


@pytest.mark.parametrize("breach_first", [True, False])
def test_a_tripped_isolation_check_of_one_choice_is_the_requests_end_whatever_came_first(
        tmp_path: Path, breach_first: bool) -> None:
    """n = 2: one choice refused (400), the other ended by an isolation check, in either order. The
    breach is what the request ended as: audited as `isolation_violation`, counted, never hidden
    behind the other choice's refusal."""
    async def scenario() -> None:
        state = await _ready_state(tmp_path)
        try:
            call = Call(state, "/v1/completions", "r")
            call.tenant = ALICE
            call.take_slots(ALICE, 2)
            call.http_done()
            call.submit([AddRequestMsg("r", ALICE.name, [5, 6], params_to_msg(SamplingParams(max_tokens=4, n=2)))])
            refused = encode(RequestRejectedMsg(call.engine_ids[1], "alice", "context_length_exceeded", "too long",
                                                None, 400))
            breach = encode(OutputsMsg([RequestOutputMsg(
                request_id=call.engine_ids[0], tenant="alice", new_token_ids=[], new_text="", finished=True,
                finish_reason="abort", stop_reason=None, num_prompt_tokens=2, num_output_tokens=0,
                num_pages_reserved=1, error="isolation check failed: a page of another tenant",
                error_code=ISOLATION_CHECK_FAILED)]))
            for message in ((breach, refused) if breach_first else (refused, breach)):
                state.engine._receive(message)
            await asyncio.sleep(0.05)
            assert _audit(tmp_path)["r"]["outcome"] == "isolation_violation"
            assert state.metrics.isolation_violations._value.get() == 1
        finally:
            _close(state)

    asyncio.run(scenario())


def test_a_key_a_reload_takes_while_the_body_comes_in_starts_nothing(tmp_path: Path) -> None:
    """A key is checked when the headers arrive; one that a reload removes (without ?abort) before
    the body has arrived is refused 401 right before the engine, as a new request would be."""
    before = _keys(tmp_path, {"key-a": {"tenant": "alice"}, "key-b": {"tenant": "bob"}})
    after = _keys(tmp_path, {"key-a": {"tenant": "alice"}})
    body = json.dumps({"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}).encode()

    async def scenario() -> None:
        state = await _ready_state(tmp_path, before)
        headed = asyncio.Event()

        async def slow_body() -> AsyncIterator[bytes]:
            yield body[:5]
            headed.set()
            await asyncio.sleep(0.2)
            state.keys = after  # what `reload_keys` does
            yield body[5:]

        try:
            transport = httpx.ASGITransport(app=build_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
                response = await asyncio.wait_for(client.post("/v1/completions", content=slow_body(), headers={
                    "Authorization": "Bearer key-b", "Content-Type": "application/json"}), timeout=10)
            assert headed.is_set()
            assert response.status_code == 401 and response.json()["error"]["code"] == "api_key_revoked"
            assert state.engine.num_in_flight == 0 and state.engine._outbox.empty()
            assert _audit(tmp_path)[response.headers["x-request-id"]]["outcome"] == "rejected"
        finally:
            _close(state)

    asyncio.run(scenario())


async def _post_while_the_body_comes(state: AppState, key: str, body: dict[str, Any],
                                     meanwhile: Any) -> httpx.Response:
    """POST `body` with `key`: its headers and first bytes first, then `meanwhile()` (a reload),
    then the rest of the body."""
    data = json.dumps(body).encode()

    async def slow_body() -> AsyncIterator[bytes]:
        yield data[:5]
        await asyncio.sleep(0.2)
        meanwhile()
        yield data[5:]

    transport = httpx.ASGITransport(app=build_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await asyncio.wait_for(client.post("/v1/completions", content=slow_body(), headers={
            "Authorization": f"Bearer {key}", "Content-Type": "application/json"}), timeout=10)


def _reloading_state(tmp_path: Path, entries: dict[str, Any]) -> tuple[AppState, Path]:
    """A ready state whose engine is down (nothing hangs on a request that gets past every check:
    it is refused 503 at submission) and its keys file, for `reload_keys`."""
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(entries))
    state = asyncio.run(_ready_state(tmp_path, ApiKeyTable.load(str(path))))
    state.config = ServerConfig(api_keys_path=str(path))
    state.engine._fail("the engine is down")
    return state, path


def _reload_to(state: AppState, path: Path, entries: dict[str, Any]) -> Any:
    def reload() -> None:
        path.write_text(json.dumps(entries))
        reload_keys(state, "http", None, abort=False)

    return reload


def test_a_reload_while_the_body_comes_in_applies_its_limits_to_that_request(tmp_path: Path) -> None:
    """"Limits change at once": a request whose headers came before a reload that lowered its
    tenant's `max_tokens` is judged by the new cap, as the same request sent after it is."""
    state, path = _reloading_state(tmp_path, {"key-a": {"tenant": "alice"}})
    try:
        reload = _reload_to(state, path, {"key-a": {"tenant": "alice", "max_tokens": 8}})
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 50}
        response = asyncio.run(_post_while_the_body_comes(state, "key-a", body, reload))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "max_tokens" and "at most 8" in response.json()["error"]["message"]
    finally:
        _close(state)


def test_a_request_from_before_a_reload_neither_resets_nor_escapes_the_new_token_limit(tmp_path: Path) -> None:
    """carol had no tokens per minute; a reload gives her 200 and she spends 400 (in debt). A
    request of hers whose headers came before that reload is refused by the new limit (429), and
    her debt is still there afterwards: the tenant copy it started with (without the limit)
    neither drops her bucket nor starts a full one."""
    state, path = _reloading_state(tmp_path, {"key-c": {"tenant": "carol"}})
    limited = {"key-c": {"tenant": "carol", "tokens_per_minute": 200}}

    def reload_then_spend() -> None:
        _reload_to(state, path, limited)()
        state.rates.charge_tokens(state.keys.current(Tenant("carol")), 400)  # a completion of hers that ended

    try:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
        response = asyncio.run(_post_while_the_body_comes(state, "key-c", body, reload_then_spend))
        assert response.status_code == 429, response.text
        assert response.json()["error"]["code"] == "rate_limit_exceeded"
        assert response.headers["x-ratelimit-limit-tokens"] == "200"
        assert response.headers["x-ratelimit-remaining-tokens"] == "0"
        with TestClient(build_app(state)) as client:  # and the next request finds the debt as it was
            again = client.post("/v1/completions", headers={"Authorization": "Bearer key-c"}, json=body)
        assert again.status_code == 429 and again.headers["x-ratelimit-remaining-tokens"] == "0", again.text
    finally:
        _close(state)


class _BrokenRates(RateLimits):
    """Per-minute limits whose arithmetic fails, as a limit too large for a float once did."""

    def _bucket(self, tenant: Tenant, kind: Any) -> Any:
        raise OverflowError("int too large to convert to float")


def test_a_refusal_whose_accounting_fails_is_still_audited_and_frees_its_slot(tmp_path: Path) -> None:
    """Defence in depth for I8: an exception from the rate limits while a request is refused (here
    every time they are asked) still leaves the request's audit line, gives back its concurrency
    slot and forgets it as a live call, so a later `?abort=true` does not count it."""
    keys = _keys(tmp_path, {"key-d": {"tenant": "dave", "max_concurrent_requests": 2, "tokens_per_minute": 100}})
    state = asyncio.run(_ready_state(tmp_path, keys))
    state.rates = _BrokenRates()
    try:
        with TestClient(build_app(state), raise_server_exceptions=False) as client:
            for _ in range(3):  # more than its 2 slots: a slot kept by a failed refusal would show as a 429
                response = client.post("/v1/completions", headers={"Authorization": "Bearer key-d"},
                                       json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2})
                assert response.status_code == 500, response.text
        records = list(_audit(tmp_path).values())
        assert [(r["tenant"], r["outcome"], r["reason"]) for r in records] == [("dave", "error", "internal_error")] * 3
        assert state.gate.num_tenants_in_flight() == 0 and not state.live_calls
    finally:
        _close(state)


async def _stats_across_a_restart(tmp_path: Path) -> tuple[float, float]:
    state = await _ready_state(tmp_path)
    try:
        state.metrics.vllm.name_model("tiny", READY.max_model_len)
        engine = state.engine
        assert isinstance(engine, EngineClient)
        engine._on_msg(EngineStatsMsg(1, 0, 10, 10, num_preemptions=3, num_pages_scrubbed=7))
        engine._process._num_starts += 1  # the engine died and was restarted: a new process counts from 0
        engine._on_msg(EngineStatsMsg(4, 2, 15, 5, num_preemptions=5, num_pages_scrubbed=9))
        registry = state.metrics.registry
        return (registry.get_sample_value("vllm:num_preemptions_total", {"model_name": "tiny", "engine": "0"}) or 0,
                registry.get_sample_value("kvseal_kv_pages_scrubbed_total") or 0)
    finally:
        _close(state)


def test_counts_survive_an_engine_restart_that_catches_up(tmp_path: Path) -> None:
    """A restarted engine counts its preemptions and scrubbed pages from 0 again; once its count
    passes the dead one's last, a total kept on its count alone lost the dead one's (3 + 5 read
    5). The client totals over its engine processes, as the PD frontend does over instances."""
    assert asyncio.run(_stats_across_a_restart(tmp_path)) == (8, 16)
