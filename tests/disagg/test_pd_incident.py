"""The incident, replayed against real PD processes (README.md and docs/SECURITY.md tell it).

Decode's pool and limit are larger than prefill's; one tenant sends prompts sized between
the two, mixed into concurrent traffic from other tenants; every prompt repeats its own
unique marker word, and the served model (`marker_model.py`) answers with the marker that
dominates the KV it attends to. A foreign marker in any response is a leak.

Both layers are shown to hold and to fail when broken: the frontend admits against the
smallest limit (and with that check switched off, prefill's re-check refuses and decode
releases); decode's verification catches the incident's placeholder prefill (and with it
switched off too, the marker check catches the leak). The switches are test-only faults.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from marker_model import marker_prompt
from pd_harness import PdPair
from pd_servers import KEYS, PREFILL_FLAGS, PdCluster, PdFrontend, assert_engines_clean
from processes import wait_for
from transports import NIXL

from kvseal import SamplingParams
from kvseal._testing.faults import Fault, inject
from kvseal.canary.evidence import ISOLATION_VIOLATIONS, PAGES_SCRUBBED, SCRUB_MODE, MetricsSnapshot, scrape
from kvseal.config import EngineArgs
from kvseal.types import ISOLATION_CHECK_FAILED

MAX_TOKENS = 6  # every answer: the marker six times
_markers = itertools.count(100)


@dataclass
class Result:
    tenant: str
    marker: int
    status: int
    text: str
    code: str | None
    request_id: str | None


def send(frontend: PdFrontend, tenant: str, length: int) -> Result:
    marker = next(_markers)
    client = openai.OpenAI(base_url=f"{frontend.url}/v1", api_key=f"key-{tenant}", max_retries=0, timeout=60)
    try:
        out = client.completions.create(model=frontend.model_name, prompt=marker_prompt(marker, length),
                                        max_tokens=MAX_TOKENS, temperature=0)
        return Result(tenant, marker, 200, out.choices[0].text, out.choices[0].finish_reason, out.id)
    except openai.APIStatusError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        return Result(tenant, marker, exc.status_code, "", body.get("code"),
                      exc.response.headers.get("x-request-id"))


def traffic(frontend: PdFrontend, oversized: list[int]) -> list[Result]:
    """alice and bob send normal prompts while mallory sends `oversized` ones, all at once."""
    jobs = [("alice", n) for n in (20, 90, 160, 230)] + [("bob", n) for n in (40, 120, 200)]  # prefill: <= 256
    jobs += [("mallory", n) for n in oversized]
    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        return list(pool.map(lambda job: send(frontend, *job), jobs))


def foreign_markers(results: list[Result]) -> list[tuple[str, str]]:
    """(tenant, foreign marker) for every response that contains a marker it was not sent."""
    words = {f"w{r.marker}": r for r in results}
    leaks = []
    for r in results:
        for word in r.text.split():
            if word in words and word != f"w{r.marker}":
                leaks.append((r.tenant, word))
    return leaks


def frontend_for(cluster: PdCluster, faults: str) -> PdFrontend:
    """A second frontend over the cluster's engines, with `faults` on in it."""
    return PdFrontend([cluster.prefill], [cluster.decode], cluster.marker_dir, cluster.workdir, KEYS,
                      faults).start().wait_healthy()


def assert_normal_traffic_answered(results: list[Result]) -> None:
    for r in results:
        if r.tenant != "mallory":
            assert r.status == 200 and r.text.split() == [f"w{r.marker}"] * MAX_TOKENS, r


def test_the_incident_prompts_get_400_and_never_reach_an_engine(pd_cluster: PdCluster) -> None:
    replay_the_incident(pd_cluster)


def test_the_incident_replay_with_tp2_on_both_sides_then_a_dead_decode_rank_fails_closed(
        pd_tp_cluster: PdCluster) -> None:
    """The same replay with `-tp 2` on prefill and decode: every handoff gathers both ranks' KV
    heads on prefill and scatters them on decode (`parallel/handoff.py`); every answer is its own
    marker, as with TP=1 and colocated, and both engines drain clean. Then decode's worker rank is
    killed: the next request gets an error, never a 200, well within the timeouts; decode exits 1
    (its ranks stopped by PID) and prefill's pages are free."""
    cluster = pd_tp_cluster
    replay_the_incident(cluster)
    assert cluster.frontend.metric("kvseal_pd_kv_transfers", role="decode") >= 7
    found = re.search(r"tensor parallel: 2 ranks \(pids \[(\d+)\]\)", cluster.decode.log())
    assert found is not None, "decode's tensor-parallel start-up line"
    os.kill(int(found.group(1)), signal.SIGKILL)
    started = time.monotonic()
    result = send(cluster.frontend, "alice", 40)
    assert result.status >= 500 and result.text == "", result
    assert time.monotonic() - started < 30
    assert cluster.decode.proc is not None and cluster.decode.proc.wait(timeout=30) == 1
    assert "a tensor-parallel rank failed" in cluster.decode.log()
    assert_engines_clean(cluster.prefill)


def replay_the_incident(pd_cluster: PdCluster) -> None:
    frontend = pd_cluster.frontend
    assert "admitting against the smallest" in frontend.log()
    results = traffic(frontend, oversized=[300, 480, 700])
    mallory = [r for r in results if r.tenant == "mallory"]
    assert all(r.status == 400 and r.code == "context_length_exceeded" for r in mallory), mallory
    assert_normal_traffic_answered(results)
    assert foreign_markers(results) == []
    audit = {r["request_id"]: r for r in frontend.audit_records()}
    for r in mallory:  # refused at the door: no engine, no transfer
        record = audit[r.request_id]
        assert record["outcome"] == "rejected" and record["http_status"] == 400
        assert "transfer_id" not in record and "decode_engine" not in record
    for r in results:
        if r.tenant != "mallory":
            assert {"prefill_engine", "decode_engine", "transfer_id"} <= audit[r.request_id].keys()
    assert frontend.metric("kvseal_pd_handoff_failures") == 0
    assert_engines_clean(pd_cluster.prefill, pd_cluster.decode)


def test_with_the_frontend_check_off_prefill_refuses_and_decode_releases(pd_cluster: PdCluster) -> None:
    frontend = frontend_for(pd_cluster, faults="skip_front_door_admission")
    try:
        transfers_before = frontend.metric("kvseal_pd_kv_transfers", role="decode")
        refused_before = frontend.metric("kvseal_pd_handoff_failures", role="decode", reason="prefill_refused")
        results = traffic(frontend, oversized=[300, 480, 700])
        mallory = [r for r in results if r.tenant == "mallory"]
        assert all(r.status == 400 and r.code == "context_length_exceeded" for r in mallory), mallory
        assert_normal_traffic_answered(results)
        assert foreign_markers(results) == []
        audit = {r["request_id"]: r for r in frontend.audit_records()}
        for r in mallory:  # decode reserved, prefill refused, decode released: never scheduled
            record = audit[r.request_id]
            assert record["outcome"] == "rejected" and record["reason"] == "context_length_exceeded"
            assert record["decode_engine"].startswith("decode-") and record["transfer_id"]
            assert record.get("output_tokens") is None and record.get("first_token_at") is None
        refused = frontend.metric("kvseal_pd_handoff_failures", role="decode", reason="prefill_refused")
        assert refused - refused_before == 3
        assert frontend.metric("kvseal_pd_kv_transfers", role="decode") - transfers_before == 7
    finally:
        frontend.terminate()
    assert_engines_clean(pd_cluster.prefill, pd_cluster.decode)


@pytest.mark.parametrize("pd_cluster", ["tcp-stream"], indirect=True)  # over nixl: test_handoff_faults.py, in-process
def test_the_placeholder_prefill_is_caught_by_decode_and_by_prefills_own_check(pd_cluster: PdCluster) -> None:
    """The incident's placeholder path switched on in prefill (restarted at the same address,
    picked up by the running frontend), in two prefill engines one after the other:

    - with prefill's own checks bypassed: decode's verification refuses every handoff, nobody
      gets an answer;
    - with its checks on (and --kv-scrub free there): prefill's own coverage check refuses the
      forward, so every client gets 500 isolation_check_failed and /metrics counts the
      violations; the pages prefill freed were scrubbed, and counted."""
    frontend = pd_cluster.frontend
    try:
        pd_cluster.replace_prefill("placeholder_prefill,bypass_kv_checks")
        frontend.wait_healthy()
        failures_before = frontend.metric("kvseal_pd_handoff_failures", role="decode", reason="missing_kv")
        results = traffic(frontend, oversized=[])
        assert all(r.status >= 500 and r.text == "" for r in results), results
        assert foreign_markers(results) == []
        failures = frontend.metric("kvseal_pd_handoff_failures", role="decode", reason="missing_kv")
        assert failures - failures_before == len(results)
        assert_engines_clean(pd_cluster.decode)

        pd_cluster.replace_prefill("placeholder_prefill", flags=[*PREFILL_FLAGS, "--kv-scrub", "free"])
        frontend.wait_healthy()
        before = scrape(frontend.url, "key-ops")
        results = [send(frontend, "alice", n) for n in (20, 90)]
        assert all(r.status == 500 and r.code == ISOLATION_CHECK_FAILED for r in results), results
        after = wait_for(lambda: _scrubbed_since(frontend, before), "prefill's scrubbed pages in /metrics")
        assert after.total(ISOLATION_VIOLATIONS) - (before.total(ISOLATION_VIOLATIONS) or 0) == len(results)
        assert after.by_label(SCRUB_MODE, "mode") == {"decode=off,prefill=free": 1.0}
        assert_engines_clean(pd_cluster.prefill, pd_cluster.decode)
    finally:
        pd_cluster.replace_prefill("none")
        frontend.wait_healthy()


def _scrubbed_since(frontend: PdFrontend, before: MetricsSnapshot) -> MetricsSnapshot | None:
    after = scrape(frontend.url, "key-ops")
    return after if (after.total(PAGES_SCRUBBED) or 0) > (before.total(PAGES_SCRUBBED) or 0) else None


@pytest.mark.parametrize("kv_transport", ["tcp", "tcp-stream", NIXL])
def test_without_decode_verification_the_marker_check_catches_the_leak(marker_dir: Path, kv_transport: str) -> None:
    """The negative control, with both engines in this process (a fault switched on here is on
    in both, and only prefill runs prompts): with decode's verification switched off too, the
    placeholder's request decodes over alice's KV and answers with alice's marker."""
    pair = PdPair(EngineArgs(model=str(marker_dir), kv_cache_tokens=256, max_model_len=256, page_size=4,
                             dtype="float32"),
                  EngineArgs(model=str(marker_dir), kv_cache_tokens=1024, max_model_len=1024, page_size=4,
                             dtype="float32"), kv_transport=kv_transport)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    tokenizer = pair.decode.engine.tokenizer
    try:
        alice = pair.generate(pair.decode.engine.tokenize(marker_prompt(400, 200)), params, tenant="alice")
        assert tokenizer.decode(alice.token_ids).split() == ["w400"] * MAX_TOKENS
        bob_prompt = pair.decode.engine.tokenize(marker_prompt(401, 150))
        with inject(Fault.PLACEHOLDER_PREFILL), inject(Fault.BYPASS_KV_CHECKS):
            caught = pair.generate(bob_prompt, params, tenant="bob")
            assert caught.final.error_code == ISOLATION_CHECK_FAILED and caught.token_ids == []
            with inject(Fault.SKIP_HANDOFF_VERIFY):
                leaked = pair.generate(bob_prompt, params, tenant="bob")
        assert leaked.final.finish_reason == "length"
        assert "w400" in tokenizer.decode(leaked.token_ids).split(), "the marker check sees alice's marker"
    finally:
        pair.close()
