"""The PD frontend's summed load: pages scrubbed (I7) is counted over every engine instance it
heard from, so it does not drop when an engine goes down or restarts with its count at 0, and
the scrub mode names each role's policy where the engines differ."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgspec
import pytest
from pd_harness import Ends
from processes import free_port

from kvseal.disagg.frontend import PdClient, PdRoute, scrub_policy
from kvseal.disagg.link_keys import EngineEndpoint, KeyPair
from kvseal.disagg.msgs import (
    RESERVATION_UNCLAIMED,
    TRANSFER_FAILED,
    AbortUnsentMsg,
    EngineInfoMsg,
    PdStatsMsg,
    PrefillMsg,
    PrefillRefusedMsg,
    ReservedMsg,
    Role,
)
from kvseal.disagg.role import aborted_output
from kvseal.engine_api import EngineGone, EngineUnavailable, RequestEvent, RequestHandle
from kvseal.messages.convert import params_to_msg
from kvseal.messages.msgs import (
    TP_RANK_LOST,
    AbortMsg,
    AddRequestMsg,
    EngineStatsMsg,
    ForgetTenantMsg,
    OutputsMsg,
    RequestOutputMsg,
    RequestRejectedMsg,
)
from kvseal.types import ENGINE_UNAVAILABLE, HANDOFF_FAILED, SamplingParams


@pytest.fixture
def client() -> Iterator[PdClient]:
    engines = [EngineEndpoint(f"127.0.0.1:{free_port()}", KeyPair.ephemeral(role).public) for role in ("p", "d")]
    pd = PdClient(engines[:1], engines[1:], "/tokenizer", KeyPair.ephemeral("frontend"))
    yield pd
    asyncio.run(pd.shutdown(timeout_s=0))


def _stats(instance_id: str, role: Role, num_pages_scrubbed: int, num_violations: int = 0) -> PdStatsMsg:
    engine = EngineStatsMsg(0, 0, 0, 64, 0, num_violations, num_pages_scrubbed)
    return PdStatsMsg(instance_id, role, engine, 64, 0, 0, 0, 0.0, {}, 0, {}, 0)


def test_pages_scrubbed_sums_engines_and_never_drops(client: PdClient) -> None:
    prefill, decode = client.links
    prefill.is_up = decode.is_up = True
    client._on_msg(prefill, _stats("prefill-1", "prefill", 5, num_violations=1))
    client._on_msg(decode, _stats("decode-1", "decode", 3))
    client._on_msg(prefill, _stats("prefill-1", "prefill", 8, num_violations=1))
    load = client.load()
    assert (load.num_pages_scrubbed, load.num_isolation_violations) == (11, 1)
    client._engine_down(prefill, "test: the prefill engine went away")
    assert client.load().num_pages_scrubbed == 11, "a down engine's scrubbed pages stay counted"
    prefill.is_up = True
    client._on_msg(prefill, _stats("prefill-2", "prefill", 2))  # restarted: counts from 0 again
    assert client.load().num_pages_scrubbed == 13


def test_preemptions_total_sums_engine_instances_and_never_drops(client: PdClient) -> None:
    """`num_preemptions` (kvseal's gauge) is the sum of the engines up now; the total behind
    vllm:num_preemptions_total keeps what a restarted engine had counted."""
    def stats(instance_id: str, role: Role, num_preemptions: int) -> PdStatsMsg:
        return PdStatsMsg(instance_id, role, EngineStatsMsg(0, 0, 0, 64, num_preemptions), 64, 0, 0, 0, 0.0, {}, 0,
                          {}, 0)

    prefill, decode = client.links
    prefill.is_up = decode.is_up = True
    client._on_msg(prefill, stats("prefill-1", "prefill", 3))
    client._on_msg(decode, stats("decode-1", "decode", 5))
    assert (client.load().num_preemptions, client.load().num_preemptions_total) == (8, 8)
    client._engine_down(prefill, "test: the prefill engine went away")
    assert (client.load().num_preemptions, client.load().num_preemptions_total) == (5, 8)
    prefill.is_up = True
    client._on_msg(prefill, stats("prefill-2", "prefill", 1))  # restarted: counts from 0 again
    assert (client.load().num_preemptions, client.load().num_preemptions_total) == (6, 9)


class _Unheard:
    """An observer for a request that must never be routed."""

    def on_output(self, out: RequestOutputMsg) -> None:
        raise AssertionError(f"routed: {out}")

    def on_terminal(self, event: RequestEvent) -> None:
        raise AssertionError(f"routed: {event}")


def test_a_request_no_prefill_engine_could_take_reserves_nothing(client: PdClient) -> None:
    """With decode up and no prefill engine, `submit` refuses at once (the server answers 503 at
    the door and gives back the tenant's per-minute quota) instead of reserving pages on decode
    for a request that then fails without running."""
    prefill, decode = client.links
    decode.is_up = True
    params = params_to_msg(SamplingParams(max_tokens=2))
    with pytest.raises(EngineUnavailable, match="no prefill engine is reachable"):
        client.submit(AddRequestMsg("r-1", "alice", [5, 6], params), _Unheard())
    assert client.num_in_flight == 0 and decode.num_assigned == 0


@pytest.mark.parametrize("relayed", [True, False], ids=["prefill's, relayed", "decode's own"])
def test_an_engine_that_lost_a_rank_ends_its_requests_as_an_engine_loss(client: PdClient, relayed: bool) -> None:
    """An engine's end of a request with code `engine_unavailable` (its tensor-parallel rank was
    lost: prefill's refusal that decode relays, or decode's own abort output) reaches the server as
    `EngineGone`: 503 `engine_unavailable`, audited as an error, not a rejection or an abort."""
    prefill, decode = client.links
    ends = Ends()
    handle = RequestHandle("r-1", "alice", ends)
    client._routes["r-1"] = PdRoute(handle, AddRequestMsg("r-1", "alice", [5, 6], params_to_msg(SamplingParams())),
                                    decode)
    if relayed:
        client._on_msg(decode, RequestRejectedMsg("r-1", "alice", ENGINE_UNAVAILABLE, TP_RANK_LOST, None, 503))
    else:
        client._on_msg(decode, OutputsMsg([aborted_output("r-1", "alice", 2, 1, TP_RANK_LOST, ENGINE_UNAVAILABLE)]))
    assert ends.events == [EngineGone(TP_RANK_LOST)] and client.num_in_flight == 0


def _info(role: Role, policy: str) -> EngineInfoMsg:
    return EngineInfoMsg(role, "127.0.0.1:1", f"{role}-1", 1, "m", "/m", "llama", 64, 256, 512, 4, 64,
                         "layout", "tcp", policy)


def test_the_scrub_policy_names_each_role_where_they_differ() -> None:
    assert scrub_policy([_info("prefill", "free"), _info("decode", "free")]) == "free"
    assert scrub_policy([_info("prefill", "free"), _info("decode", "off")]) == "decode=off,prefill=free"


def test_a_key_refused_before_start_is_still_reported(caplog: pytest.LogCaptureFixture) -> None:
    """The frontend's links connect as it is made, and an engine that refuses its key does so at
    once, never again (ZMQ does not retry a refused key). The link's monitor is attached before it
    connects, so `start` still reports the refusal with its fix, however long it came after:
    with the monitor attached in `start` (as before), this failed when the refusal won the race."""
    import zmq

    from kvseal.disagg.link_auth import LinkGuard
    from kvseal.disagg.link_keys import EngineLinkKeys, PublicKey
    from kvseal.errors import ConfigError

    ctx = zmq.Context()
    engine_key = KeyPair.ephemeral("prefill")
    guard = LinkGuard(ctx, EngineLinkKeys(engine_key, (PublicKey("other", KeyPair.ephemeral("other").public),)),
                      "kvseal-test")
    router = ctx.socket(zmq.ROUTER)
    guard.secure_server(router)
    address = f"127.0.0.1:{free_port()}"
    router.bind(f"tcp://{address}")
    pd = PdClient([EngineEndpoint(address, engine_key.public)], [], "/tokenizer", KeyPair.ephemeral("frontend"))

    async def start_then_stop() -> None:
        try:
            await pd.start(timeout_s=1.0)
        finally:
            await pd.shutdown(timeout_s=0)

    try:
        for _ in range(100):  # the refusal happens before `start` runs
            if guard.take_handshake_failures() or guard.refused_handshakes:
                break
            router.poll(50)
        assert guard.refused_handshakes["unlisted_key"] >= 1
        with caplog.at_level("ERROR", logger="kvseal.server"), pytest.raises(ConfigError, match="no answer"):
            asyncio.run(start_then_stop())
        assert any("refused this frontend's key" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        guard.monitor.close(linger=0)
        router.close(linger=0)
        guard.close()
        ctx.term()


def test_a_restarted_prefill_engine_hears_a_forget_again_while_older_requests_wait(client: PdClient) -> None:
    """A forget reached the prefill engine; it then restarts, so its new process counts alice's
    cache epoch from 0 again. alice's request reserved before the forget, not yet sent to prefill,
    must not share a namespace there with the name's next holder: the forget is sent again, with
    that request named, before the new engine is used. Decode's restart needs none (its
    reservations went with it), and once the request has reached prefill none is owed either."""
    prefill, decode = client.links
    sent: dict[str, list[object]] = {"prefill": [], "decode": []}
    for link in (prefill, decode):
        link.send = sent[link.role].append  # type: ignore[method-assign]
        client._on_info(link, msgspec.structs.replace(_info(link.role, "zero"), instance_id=f"{link.role}-1"))
    handle = RequestHandle("r-old", "alice", Ends())
    route = PdRoute(handle, AddRequestMsg("r-old", "alice", [5, 6], params_to_msg(SamplingParams(max_tokens=2))),
                    decode)
    client._routes["r-old"] = route
    client.forget_tenant("alice")
    assert sent["prefill"] == [ForgetTenantMsg("alice", ["r-old"])] and sent["decode"] == [ForgetTenantMsg("alice")]
    client._on_info(prefill, msgspec.structs.replace(_info("prefill", "zero"), instance_id="prefill-2"))  # restarted
    assert sent["prefill"][1:] == [ForgetTenantMsg("alice", ["r-old"])]
    route.prefill = prefill  # sent on: a later restart owes nothing (and ends it)
    client._on_info(prefill, msgspec.structs.replace(_info("prefill", "zero"), instance_id="prefill-3"))
    assert sent["prefill"][2:] == []
    assert sent["decode"][1:] == [AbortMsg("r-old", "alice", "the prefill engine restarted")]



def test_forgotten_names_are_kept_only_while_a_request_of_theirs_waits_for_prefill(client: PdClient) -> None:
    """The names the frontend remembers as forgotten (to tell a restarted prefill engine again)
    are those a request reserved before the forget still waits for prefill under: a name with
    none is not kept, and one is dropped when its last such request ends. However many names the
    operator forgets, the frontend keeps at most one per request in flight."""
    prefill, decode = client.links
    sent: dict[str, list[object]] = {"prefill": [], "decode": []}
    for link in (prefill, decode):
        link.send = sent[link.role].append  # type: ignore[method-assign]
        client._on_info(link, msgspec.structs.replace(_info(link.role, "zero"), instance_id=f"{link.role}-1"))
    for number in range(100):
        client.forget_tenant(f"gone-{number}")
    assert client._forgotten == set()
    ends = Ends()
    client._routes["r-old"] = PdRoute(RequestHandle("r-old", "alice", ends), AddRequestMsg(
        "r-old", "alice", [5, 6], params_to_msg(SamplingParams(max_tokens=2))), decode)
    decode.num_assigned = 1
    client.forget_tenant("alice")
    client.forget_tenant("bob")
    assert client._forgotten == {"alice"}
    client._on_msg(decode, OutputsMsg([aborted_output("r-old", "alice", 2, 1, "ended", None)]))
    assert ends.events and client._forgotten == set() and client.num_in_flight == 0


def test_a_transfer_prefill_could_not_make_is_the_engines_failure(client: PdClient) -> None:
    """Prefill could not reach decode (its push, and so its word to decode, failed): the frontend
    ends the reservation on decode and the request here as what it is, 502 with prefill's code,
    not as decode's answer to a plain abort (which the server would take for an abort)."""
    ends, sent = _routed_to_both(client)
    prefill, decode = client.links
    client._on_prefill_result(prefill, PrefillRefusedMsg("r-t", "t-1", "prefill-1", TRANSFER_FAILED,
                                                         "the KV transfer to decode failed: unreachable", None, 502))
    assert sent["decode"] == [AbortMsg("r-t", "alice", "the KV transfer to decode failed: unreachable")]
    assert ends.events == [RequestRejectedMsg("r-t", "alice", TRANSFER_FAILED,
                                              "the KV transfer to decode failed: unreachable", None, 502)]
    assert client.num_in_flight == 0 and prefill.num_assigned == decode.num_assigned == 0


def test_an_abort_before_prefill_was_asked_tells_decode_so(client: PdClient) -> None:
    """The client leaves before the frontend sent PrefillMsg: decode is told `AbortUnsentMsg` (it
    frees the reservation at once, no prefill engine having the transfer), the reservation that
    comes back afterwards is not sent to prefill, and decode hears of it as unclaimed. Once
    PrefillMsg went, an abort is the plain `AbortMsg` to both engines (decode waits for prefill's
    last word before it frees the pages)."""
    prefill, decode = client.links
    sent: dict[str, list[object]] = {"prefill": [], "decode": []}
    for link in (prefill, decode):
        link.send = sent[link.role].append  # type: ignore[method-assign]
        client._on_info(link, msgspec.structs.replace(_info(link.role, "zero"), instance_id=f"{link.role}-1"))
    params = params_to_msg(SamplingParams(max_tokens=2))
    reserved = {}
    for request_id in ("r-early", "r-late"):
        client.submit(AddRequestMsg(request_id, "alice", [5, 6], params), Ends())
        reserved[request_id] = ReservedMsg(request_id, "alice", f"t-{request_id}", [0], 4, "nixl:x", bytes(32))
    client._on_msg(decode, reserved["r-late"])
    client.abort("r-early", "alice", "client_disconnected")
    client.abort("r-late", "alice", "client_disconnected")
    client._on_msg(decode, reserved["r-early"])
    assert [type(m) for m in sent["prefill"]] == [PrefillMsg, AbortMsg]  # r-late's only
    assert sent["decode"][2:] == [AbortUnsentMsg("r-early", "alice", "client_disconnected"),
                                  AbortMsg("r-late", "alice", "client_disconnected"),
                                  AbortUnsentMsg("r-early", "alice", RESERVATION_UNCLAIMED)]


def _routed_to_both(client: PdClient) -> tuple[Ends, dict[str, list[object]]]:
    """Request r-t of alice, reserved on decode (transfer t-1) and sent to prefill; what each engine is sent."""
    prefill, decode = client.links
    sent: dict[str, list[object]] = {"prefill": [], "decode": []}
    for link in (prefill, decode):
        link.send = sent[link.role].append  # type: ignore[method-assign]
        client._on_info(link, msgspec.structs.replace(_info(link.role, "zero"), instance_id=f"{link.role}-1"))
    ends = Ends()
    route = PdRoute(RequestHandle("r-t", "alice", ends),
                    AddRequestMsg("r-t", "alice", [5, 6], params_to_msg(SamplingParams(max_tokens=2))), decode,
                    prefill=prefill, transfer_id="t-1")
    client._routes["r-t"] = route
    client._by_transfer["t-1"] = route
    prefill.num_assigned = decode.num_assigned = 1
    return ends, sent


@pytest.mark.parametrize("decode_heard", [True, False], ids=["decode relays it", "decode expired it"])
def test_prefills_own_refusal_is_the_answer_whatever_decode_heard(client: PdClient, decode_heard: bool) -> None:
    """Prefill refused the request with its own code (a 400). Decode relays that refusal when
    prefill's word reached it; when it did not (prefill could not reach decode), decode expires
    the reservation and reports a failed handoff. Either way the server gets prefill's refusal,
    its code, status and param: the client's 400 with its OpenAI body, never a 503 to retry."""
    prefill, decode = client.links
    ends, sent = _routed_to_both(client)
    client._on_msg(prefill, PrefillRefusedMsg("r-t", "t-1", "prefill-1", "context_length_exceeded", "too long",
                                              "prompt", 400))
    refusal = RequestRejectedMsg("r-t", "alice", "context_length_exceeded", "too long", "prompt", 400)
    decode_end = refusal if decode_heard else OutputsMsg([aborted_output(
        "r-t", "alice", 2, 1, "no sign of the prefill engine for 30 s", HANDOFF_FAILED)])
    client._on_msg(decode, decode_end)
    assert ends.events == [refusal]
    assert sent["decode"] == [] and client.num_in_flight == 0 and prefill.num_assigned == decode.num_assigned == 0


def test_a_failed_handoff_prefill_did_not_refuse_stays_a_failed_handoff(client: PdClient) -> None:
    """Without a refusal from prefill (it went silent, or it pushed), decode's expiry is what it says."""
    _, decode = client.links
    ends, _ = _routed_to_both(client)
    expired = aborted_output("r-t", "alice", 2, 1, "no sign of the prefill engine for 30 s", HANDOFF_FAILED)
    client._on_msg(decode, OutputsMsg([expired]))
    assert [getattr(e, "error_code", None) for e in ends.events] == [HANDOFF_FAILED]
