"""The incident, replayed against real PD processes (DESIGN.md §1).

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
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from marker_model import make_marker_model, marker_prompt
from pd_harness import PdPair
from pd_servers import PdEngine, PdFrontend, assert_engines_clean

from kvseal import SamplingParams
from kvseal._testing.faults import Fault, inject
from kvseal.config import EngineArgs
from kvseal.types import ISOLATION_CHECK_FAILED

KEYS = {"key-alice": {"tenant": "alice"}, "key-bob": {"tenant": "bob"}, "key-mallory": {"tenant": "mallory"}}
PREFILL_FLAGS = ["--kv-cache-tokens", "256", "--max-model-len", "256"]  # the small prefill pool
DECODE_FLAGS = ["--kv-cache-tokens", "1024", "--max-model-len", "1024"]
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
    jobs = [("alice", n) for n in (20, 90, 160, 230)] + [("bob", n) for n in (40, 120, 200)]
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


@pytest.fixture(scope="module")
def marker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_marker_model(tmp_path_factory.mktemp("models") / "marker")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pd-incident")


@pytest.fixture(scope="module")
def engines(marker_dir: Path, workdir: Path) -> Iterator[tuple[PdEngine, PdEngine]]:
    prefill = PdEngine("prefill", marker_dir, workdir, PREFILL_FLAGS).start()
    decode = PdEngine("decode", marker_dir, workdir, DECODE_FLAGS).start()
    try:
        yield prefill.wait_ready(), decode.wait_ready()
    finally:
        prefill.terminate()
        decode.terminate()


def frontend_for(prefill: PdEngine, decode: PdEngine, marker_dir: Path, workdir: Path,
                 faults: str = "none") -> PdFrontend:
    return PdFrontend([prefill], [decode], marker_dir, workdir, KEYS, faults).start().wait_healthy()


def assert_normal_traffic_answered(results: list[Result]) -> None:
    for r in results:
        if r.tenant != "mallory":
            assert r.status == 200 and r.text.split() == [f"w{r.marker}"] * MAX_TOKENS, r


def test_the_incident_prompts_get_400_and_never_reach_an_engine(
        engines: tuple[PdEngine, PdEngine], marker_dir: Path, workdir: Path) -> None:
    prefill, decode = engines
    frontend = frontend_for(prefill, decode, marker_dir, workdir)
    try:
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
    finally:
        frontend.terminate()
    assert_engines_clean(prefill, decode)


def test_with_the_frontend_check_off_prefill_refuses_and_decode_releases(
        engines: tuple[PdEngine, PdEngine], marker_dir: Path, workdir: Path) -> None:
    prefill, decode = engines
    frontend = frontend_for(prefill, decode, marker_dir, workdir, faults="frontend_largest_limit")
    try:
        transfers_before = frontend.metric("kvseal_pd_kv_transfers", role="decode")
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
        assert frontend.metric("kvseal_pd_handoff_failures", role="decode", reason="prefill_refused") == 3
        assert frontend.metric("kvseal_pd_kv_transfers", role="decode") - transfers_before == 7
    finally:
        frontend.terminate()
    assert_engines_clean(prefill, decode)


def test_decode_verification_catches_the_placeholder_prefill(
        engines: tuple[PdEngine, PdEngine], marker_dir: Path, workdir: Path) -> None:
    _, decode = engines
    broken = PdEngine("prefill", marker_dir, workdir, PREFILL_FLAGS,
                      faults="placeholder_prefill,bypass_kv_checks").start().wait_ready()
    frontend = frontend_for(broken, decode, marker_dir, workdir)
    try:
        results = traffic(frontend, oversized=[])
        assert all(r.status >= 500 and r.text == "" for r in results), results
        assert foreign_markers(results) == []
        assert frontend.metric("kvseal_pd_handoff_failures", role="decode", reason="missing_kv") == len(results)
    finally:
        frontend.terminate()
        broken.terminate()
    assert_engines_clean(decode)


def test_without_decode_verification_the_marker_check_catches_the_leak(marker_dir: Path) -> None:
    """The negative control, with both engines in this process (a fault switched on here is on
    in both, and only prefill runs prompts): with decode's verification switched off too, the
    placeholder's request decodes over alice's KV and answers with alice's marker."""
    pair = PdPair(EngineArgs(model=str(marker_dir), kv_cache_tokens=256, max_model_len=256, page_size=4,
                             dtype="float32"),
                  EngineArgs(model=str(marker_dir), kv_cache_tokens=1024, max_model_len=1024, page_size=4,
                             dtype="float32"))
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
