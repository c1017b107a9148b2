"""Clients leave and engines die mid-handoff: the frontend fails the requests with errors in
bounded time, the engines release what those requests held, and an engine restarted at the
same address is used again without restarting the frontend. (Runs on the shared cluster,
after the incident tests.)"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
from marker_model import marker_prompt
from pd_servers import PREFILL_FLAGS, PdCluster, assert_engines_clean
from processes import wait_for
from test_pd_incident import MAX_TOKENS, Result, send

LONG = 240  # tokens: under prefill's limit, 30 prefill steps of 8 tokens each


def assert_errors(results: list[Result]) -> None:
    """Requests caught by the kill ended with an error status (never 200 with a finish reason);
    any that finished before it got their complete, own answer."""
    assert any(r.status >= 500 for r in results), results
    for r in results:
        assert (r.status >= 500 and r.text == "") or (
            r.status == 200 and r.text.split() == [f"w{r.marker}"] * MAX_TOKENS), r


def assert_serving(cluster: PdCluster) -> None:
    ok = send(cluster.frontend, "bob", 40)
    assert ok.status == 200 and ok.text.split() == [f"w{ok.marker}"] * MAX_TOKENS, ok


def kill_during_handoffs(cluster: PdCluster, kill: str, restart: bool = False) -> list[Result]:
    """Send six long prompts (prefill works through them one after another); kill an engine
    while decode holds a reservation waiting for prefill's KV (and start it again at once at
    the same address, if `restart`)."""
    frontend = cluster.frontend
    reserved_before = frontend.metric("kvseal_pd_reservations", role="decode")
    with ThreadPoolExecutor(max_workers=6) as pool:
        futures: list[Future[Result]] = [pool.submit(send, frontend, "alice", LONG) for _ in range(6)]
        wait_for(lambda: frontend.metric("kvseal_pd_reservations", role="decode") - reserved_before >= 1,
                 "decode's reservations")
        getattr(cluster, kill).kill()
        if restart:
            getattr(cluster, kill).start()
        return [f.result() for f in futures]


def test_client_disconnect_during_the_handoff(pd_cluster: PdCluster) -> None:
    """The client leaves while its KV is being computed: both engines end the request and
    free everything; the audit says aborted."""
    frontend = pd_cluster.frontend
    body = {"prompt": marker_prompt(77, LONG), "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True}
    with httpx.Client(timeout=60) as client, client.stream(
            "POST", f"{frontend.url}/v1/completions", json=body, headers={"authorization": "Bearer key-alice"}) as r:
        request_id = r.headers["x-request-id"]  # submitted; prefill needs 30 steps: leave now
    record = wait_for(lambda: next((a for a in frontend.audit_records() if a["request_id"] == request_id), None),
                      "the audit record")
    assert record["outcome"] == "aborted" and record.get("output_tokens") in (None, 0), record
    assert_engines_clean(pd_cluster.prefill, pd_cluster.decode)


def test_prefill_killed_mid_transfer(pd_cluster: PdCluster) -> None:
    results = kill_during_handoffs(pd_cluster, "prefill")
    assert_errors(results)
    # what the clients were told (the audit keeps it): the role, never the engine's address
    ids = {r.request_id for r in results if r.status >= 500}
    told = [a for a in pd_cluster.frontend.audit_records() if a["request_id"] in ids]
    assert told and all(a["reason"] == "engine_unavailable" for a in told), [a["reason"] for a in told]
    assert not any(pd_cluster.prefill.address in a.get("detail", "") for a in told), told
    assert_engines_clean(pd_cluster.decode)  # its reservations were released; decode holds nothing
    assert pd_cluster.frontend.health() == 503
    pd_cluster.prefill.start().wait_ready()  # the same address, a new instance
    pd_cluster.frontend.wait_healthy()
    assert_serving(pd_cluster)
    assert_engines_clean(pd_cluster.prefill, pd_cluster.decode)


@pytest.mark.parametrize("pd_cluster", ["tcp-stream"], indirect=True)  # nixl's peer-gone case: the restart test below
def test_decode_killed(pd_cluster: PdCluster) -> None:
    results = kill_during_handoffs(pd_cluster, "decode")
    assert_errors(results)
    assert pd_cluster.frontend.health() == 503
    assert_engines_clean(pd_cluster.prefill)  # prefill freed what it held for the dead decode's requests
    pd_cluster.decode.start().wait_ready()
    pd_cluster.frontend.wait_healthy()
    assert_serving(pd_cluster)
    assert_engines_clean(pd_cluster.prefill, pd_cluster.decode)


def test_decode_restarted_mid_transfer_resets_the_link(pd_cluster: PdCluster) -> None:
    """Prefill's connection to decode is reset under running handoffs and a new decode instance
    answers at the same address: the requests end with errors (the new instance knows none of
    their transfers and takes none of their KV), and nothing is leaked on either engine."""
    results = kill_during_handoffs(pd_cluster, "decode", restart=True)
    assert_errors(results)
    pd_cluster.decode.wait_ready()
    pd_cluster.frontend.wait_healthy()
    assert_serving(pd_cluster)
    assert_engines_clean(pd_cluster.prefill, pd_cluster.decode)


@pytest.mark.parametrize("pd_cluster", ["tcp-stream"], indirect=True)  # the limits do not depend on the transport
def test_the_frontend_rereads_the_limits_of_a_restarted_engine(pd_cluster: PdCluster) -> None:
    """A prefill engine restarted at the same address with a smaller limit: the frontend admits
    against it (400 at the door, no engine sees the prompt), and against the larger one again
    once the engine is back with it, all without restarting the frontend."""
    frontend = pd_cluster.frontend

    def max_model_len() -> int:
        response = httpx.get(f"{frontend.url}/v1/models", headers={"authorization": "Bearer key-alice"}, timeout=10)
        return int(response.json()["data"][0]["max_model_len"])

    small = [flag.replace("256", "128") for flag in PREFILL_FLAGS]
    try:
        pd_cluster.replace_prefill("none", small)
        wait_for(lambda: max_model_len() == 128, "the frontend to admit against the restarted engine's limit")
        refused = send(frontend, "alice", 200)
        assert refused.status == 400 and refused.code == "context_length_exceeded", refused
    finally:
        pd_cluster.replace_prefill("none")
    wait_for(lambda: max_model_len() == 256, "the frontend to admit against the restored limit")
    frontend.wait_healthy()
    served = send(frontend, "alice", 200)
    assert served.status == 200 and served.text.split() == [f"w{served.marker}"] * MAX_TOKENS, served
    assert_engines_clean(pd_cluster.prefill, pd_cluster.decode)
