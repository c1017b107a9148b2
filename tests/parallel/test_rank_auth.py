"""Rank-link authentication with processes: a TP=2 engine's ranks prove the engine's key and
serve, the key never shows in a worker's /proc, and a rogue that joins the rendezvous as rank 1
without the key is refused before it receives any step (and, with the check switched off by
the test-only fault, is shown to receive one: the negative control).

Each test starts a worker rank or a rogue process, so this module is in the integration tier.
"""

from __future__ import annotations

import contextlib
import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from processes import free_port
from tiny_models import make_tiny_model

from kvseal import LLM, FinishReason, SamplingParams
from kvseal._testing.faults import Fault, inject
from kvseal.parallel import tp_key
from kvseal.parallel.group import RankFailure
from kvseal.parallel.tp_key import write_tp_key

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
ENGINE = dict(kv_cache_tokens=256, max_model_len=64, page_size=4, dtype="float32", tp_timeout_s=10.0)
NUM_PAGES = 64  # kv_cache_tokens / page_size: what a rogue must claim to pass rank 0's page check
ALICES_PROMPT = [101, 102, 103, 104, 105, 106, 107, 108]  # alice's secret, as token ids
ROGUE = Path(__file__).parent / "rogue_rank.py"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("rank-auth") / "llama")


def test_tp2_ranks_authenticate_and_serve_with_the_key_outside_argv_and_environment(
        model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = bytes(range(200, 232))  # a recognisable key, where the engine would draw a fresh one
    monkeypatch.setattr(tp_key, "new_secret", lambda: key)
    llm = LLM(str(model), tensor_parallel_size=2, **ENGINE)
    try:
        assert llm.engine.driver is not None
        (pid,) = llm.engine.driver.ranks.pids
        for name in ("cmdline", "environ"):
            shown = Path(f"/proc/{pid}/{name}").read_bytes()
            for form in (key, key.hex().encode(), key.hex().upper().encode()):
                assert form not in shown, f"the ranks' key is in worker {pid}'s /proc/{name}"
        store = llm.engine.driver.group.spec.store_path
        assert store is not None and stat.S_IMODE(Path(store).parent.stat().st_mode) == 0o700, \
            "one node meets in a file store no other user can open"
        out = llm.generate([ALICES_PROMPT], GREEDY)[0]
        assert out.finish_reason is FinishReason.LENGTH and len(out.token_ids) == 4
    finally:
        llm.engine.close()
    assert not Path(store).parent.exists(), "the store's folder goes with the engine"


@pytest.mark.parametrize("check", ["on", "off"])
def test_a_rogue_joining_as_rank_1_without_the_key_is_refused_before_any_step(
        model: Path, tmp_path: Path, check: str) -> None:
    """Node 0's engine waits for rank 1 at --master-port; a rogue gets there first with a key of
    its own. With the check on: the engine refuses to start (a clear RankFailure) and the rogue
    received the handshake's 64 bytes and nothing else. With the check off (`SKIP_RANK_AUTH`,
    the negative control): the rogue is accepted and receives alice's token ids in a step."""
    key_file = write_tp_key(tmp_path / "tp.key")
    port, record = free_port(), tmp_path / "rogue.json"
    rogue = subprocess.Popen([sys.executable, str(ROGUE), str(port), str(record), str(NUM_PAGES)],
                             start_new_session=True)
    try:
        with inject(Fault.SKIP_RANK_AUTH) if check == "off" else contextlib.nullcontext():
            _run_engine_against(model, port, key_file, check)
        rogue.wait(timeout=60)
    finally:
        if rogue.poll() is None:
            rogue.kill()
            rogue.wait()
    got = json.loads(record.read_text())
    assert got["handshake_bytes"] > 0, "the rogue reached the handshake (the rendezvous let it in as rank 1)"
    steps = [m for m in got["messages"] if m["type"] == "StepMsg"]
    if check == "on":
        assert got["messages"] == [], "a refused rank receives nothing past the handshake"
    else:
        assert steps and steps[0]["input_ids"] == ALICES_PROMPT and steps[0]["request_ids"] == ["alice-1"]


def _run_engine_against(model: Path, port: int, key_file: Path, check: str) -> None:
    args = dict(tensor_parallel_size=2, nnodes=2, master_port=port, tp_key_file=str(key_file), **ENGINE)
    if check == "on":
        with pytest.raises(RankFailure, match=r"rank\(s\) \[1\] did not prove they hold the engine's key"):
            LLM(str(model), **args)
        return
    llm = LLM(str(model), **args)
    try:
        llm.engine.add_request("alice-1", ALICES_PROMPT, GREEDY, tenant="alice")
        with pytest.raises(RankFailure):  # the rogue left with the batch; the forward then fails
            for _ in range(5):
                llm.engine.step()
    finally:
        llm.engine.close()
