"""PD with tensor-parallel engines (kvseal/parallel/handoff.py): full pages on the wire, each rank's
KV heads gathered on prefill and scattered on decode, every rank's records checked.

Both engines run in this process (`PdPair`); one of them is tensor-parallel, its worker rank in a
process of its own (gloo over 127.0.0.1, every wait bounded by `tp_timeout_s`): torch.distributed
has one default group per process, so TP=2 on both sides runs as processes, in the incident replay
(test_pd_incident.py, `pd_tp_cluster`).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_harness import MAX_ITERATIONS, PdKeys, PdPair, SharedPair
from processes import WAIT_DEADLINE_S
from tiny_models import make_tiny_model

from kvseal import LLM, SamplingParams
from kvseal._testing.faults import Fault, inject
from kvseal.cli import main
from kvseal.config import EngineArgs
from kvseal.disagg.config import NodeConfig
from kvseal.disagg.engine_main import end_on_rank_failure, end_on_shutdown
from kvseal.disagg.msgs import PrefillRefusedMsg
from kvseal.disagg.node import EngineNode
from kvseal.engine.engine import LLMEngine
from kvseal.errors import ConfigError
from kvseal.messages.msgs import TP_RANK_LOST
from kvseal.parallel.group import RankFailure
from kvseal.types import ENGINE_UNAVAILABLE, ISOLATION_CHECK_FAILED

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [list(range(10, 13)), list(range(40, 48)), list(range(100, 137)), [7]]
BASE: dict[str, Any] = dict(kv_cache_tokens=256, page_size=4, max_num_batched_tokens=32, dtype="float32",
                            max_model_len=128, tp_timeout_s=20.0)


@pytest.fixture(scope="module")
def odd_split_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """3 KV heads: 2 + 1 over two ranks, so the ranks' shards differ in size (padded on the wire)."""
    return make_tiny_model("llama_odd_split", tmp_path_factory.mktemp("pd-tp") / "odd")


def _args(model: Path, tp: int) -> EngineArgs:
    return EngineArgs(model=str(model), tensor_parallel_size=tp, **BASE)


def _colocated(model: Path) -> list[list[int]]:
    llm = LLM(str(model), **BASE)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def shared_pair(odd_split_dir: Path) -> Iterator[SharedPair]:
    """A pair over the odd-split model lent to one test after another with the same sides (a
    worker rank's start saved per test), every fault off on the TP engines' rank 1 when it comes
    back (faults this process holds are `inject`'s, off when its block ends).

    torch.distributed has one default group per process, so one TP engine at a time lives here:
    lent with other sides, the pair is closed and another started, and a test that starts its
    own TP engine gets the shared one closed first (`one_tp_engine_at_a_time`)."""
    def make(sides: tuple[int, int]) -> PdPair:
        return PdPair(_args(odd_split_dir, sides[0]), _args(odd_split_dir, sides[1]), kv_transport="tcp-stream")

    shared = SharedPair(make, reset=_faults_off)
    yield shared
    shared.close()


def _faults_off(pair: PdPair) -> None:
    for node in (pair.prefill, pair.decode):
        if node.engine.driver is not None:
            for fault in Fault:
                node.engine.driver.inject_fault_on_rank(1, fault, active=False)


@pytest.fixture(autouse=True)
def one_tp_engine_at_a_time(shared_pair: SharedPair, request: pytest.FixtureRequest) -> None:
    if "tp_pair" not in request.fixturenames:
        shared_pair.close()


@pytest.fixture
def tp_pair(shared_pair: SharedPair, request: pytest.FixtureRequest) -> Iterator[PdPair]:
    """The pair (prefill's TP, decode's TP) = `request.param`, shared by consecutive tests."""
    yield from shared_pair.lend(request.param)


@pytest.mark.parametrize("tp_pair", [(2, 1), (1, 2)], indirect=True, ids=["tp2-tp1", "tp1-tp2"])
def test_pd_with_tp_equals_colocated(tp_pair: PdPair, odd_split_dir: Path) -> None:
    """Greedy output of PD with TP on either side or both equals the colocated engine's, the
    handoffs run side by side, and every page on both sides is free afterwards."""
    expected = _colocated(odd_split_dir)
    violations_before = [node.engine.stats().num_isolation_violations for node in (tp_pair.prefill, tp_pair.decode)]
    handoffs = tp_pair.generate_all(PROMPTS, GREEDY)
    assert [h.token_ids for h in handoffs] == expected
    tp_pair.assert_clean()
    for node, before in zip((tp_pair.prefill, tp_pair.decode), violations_before):
        assert node.engine.stats().num_isolation_violations == before  # none here (the pair may be shared)
        if node.handoff is not None:  # nothing of any handoff stays in rank 0's staging pool
            assert all(not bool(t.any()) for t in (*node.handoff.wire.k, *node.handoff.wire.v))


@pytest.mark.parametrize("tp_pair", [(1, 2)], indirect=True, ids=["tp1-tp2"])
def test_a_decode_rank_that_drops_its_shard_is_caught_on_every_layer_of_defence(tp_pair: PdPair) -> None:
    """DROP_IMPORT_SHARD on decode's rank 1 only: its own records show nothing landed, so its
    report refuses the handoff; with decode's verification skipped too, rank 1's always-on check
    refuses the first decode step; with that check bypassed on rank 1 as well (the negative
    control), the request is answered from KV that never landed there."""
    pair, driver = tp_pair, tp_pair.decode.engine.driver
    assert driver is not None
    prompt = list(range(60, 90))
    expected = pair.generate(prompt, GREEDY).token_ids
    missing_before = pair.decode.steps.counters.failures["missing_kv_on_rank"]
    driver.inject_fault_on_rank(1, Fault.DROP_IMPORT_SHARD)

    refused = pair.generate(prompt, GREEDY)
    assert refused.final.error_code == ISOLATION_CHECK_FAILED and refused.token_ids == [], refused.final
    assert "did not land on tensor-parallel rank(s) 1" in (refused.final.error or "")
    assert pair.decode.steps.counters.failures["missing_kv_on_rank"] == missing_before + 1
    with inject(Fault.SKIP_HANDOFF_VERIFY):
        stepped = pair.generate(prompt, GREEDY)
        assert stepped.final.error_code == ISOLATION_CHECK_FAILED, stepped.final
        assert "on tensor-parallel rank 1" in (stepped.final.error or "")
        driver.inject_fault_on_rank(1, Fault.BYPASS_KV_CHECKS)
        leaked = pair.generate(prompt, GREEDY)
    driver.inject_fault_on_rank(1, Fault.BYPASS_KV_CHECKS, active=False)
    driver.inject_fault_on_rank(1, Fault.DROP_IMPORT_SHARD, active=False)
    assert leaked.final.finish_reason == "length" and leaked.final.error_code is None
    assert leaked.token_ids != expected, "rank 1 attended to KV that never landed there"
    assert pair.generate(prompt, GREEDY).token_ids == expected  # the faults off: served again
    pair.assert_clean()


def test_the_kv_budget_pays_for_rank_0s_staging_pool_as_plan_prints_it(odd_split_dir: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """A PD role's TP engine holds on rank 0 its pool and a staging pool of the same pages with
    every KV head: on the CPU, --kv-cache-memory pays for both (not 2.5x the budget on rank 0),
    and `kvseal plan --tp 2 --pd-role` prints the pages and bytes the engine allocates. A TP
    engine not sized for a role is refused a role."""
    sized = {**BASE, "kv_cache_tokens": None, "kv_cache_memory": "300KiB", "max_model_len": 64}
    flags = ["--model", str(odd_split_dir), "--tp", "2", "--kv-cache-memory", "300KiB", "--max-model-len", "64",
             "--dtype", "float32", "--page-size", "4"]
    assert main(["plan", *flags, "--pd-role"]) == 0
    out = capsys.readouterr().out
    num_pages = int(re.search(r"pool\s+([\d,]+) pages", out).group(1).replace(",", ""))  # type: ignore[union-attr]
    staging = re.search(r"PD staging \(rank 0\)\s+[\d,]+ pages x [\d,]+ bytes \(all 3 KV heads\) = ([\d,]+) bytes; "
                        r"with the pool ([\d,]+) bytes: ([\d,]+) bytes on rank 0", out)
    assert staging is not None, out
    staging_bytes, pool_bytes, total = (int(g.replace(",", "")) for g in staging.groups())
    assert main(["plan", *flags]) == 0  # the colocated engine: no staging, more pages
    assert num_pages < int(re.search(r"pool\s+([\d,]+) pages", capsys.readouterr().out)  # type: ignore[union-attr]
                           .group(1).replace(",", ""))
    args = EngineArgs(model=str(odd_split_dir), tensor_parallel_size=2, **sized)
    pair = PdPair(args, EngineArgs(model=str(odd_split_dir), **sized), kv_transport="tcp-stream")
    try:
        engine, handoff = pair.prefill.engine, pair.prefill.handoff
        assert handoff is not None and engine.cache_config.num_pages == num_pages
        assert (handoff.wire.num_bytes, engine.kv.pool.num_bytes) == (staging_bytes, pool_bytes)
        assert total == staging_bytes + pool_bytes <= 300 * 1024
        assert pair.generate(PROMPTS[2], GREEDY).token_ids == _colocated(odd_split_dir)[2]
    finally:
        pair.close()
    unsized = LLMEngine(args)
    try:
        with pytest.raises(ConfigError, match="pd_role=True"):
            EngineNode(unsized, NodeConfig("prefill", "127.0.0.1:1", link_keys=PdKeys.ephemeral().of_prefill()))
    finally:
        unsized.close()


@pytest.mark.parametrize("sides", [(2, 1), (1, 2)], ids=["tp2-tp1", "tp1-tp2"])
def test_pd_with_a_replicated_kv_head_equals_colocated(tmp_path: Path, sides: tuple[int, int]) -> None:
    """One KV head over two ranks: both hold it. Prefill's rank 0 stages its own copy and
    discards rank 1's; decode's rank 0 hands rank 1 the same head it keeps."""
    model = make_tiny_model("llama_one_kv_head", tmp_path / "one")
    pair = PdPair(_args(model, sides[0]), _args(model, sides[1]), kv_transport="tcp-stream")
    try:
        assert [h.token_ids for h in pair.generate_all(PROMPTS, GREEDY)] == _colocated(model)
        pair.assert_clean()
    finally:
        pair.close()


def _until_rank_failure(pair: PdPair, node: EngineNode) -> RankFailure:
    """Run both loops until `node`'s raises the lost rank's `RankFailure` (at its next step's collective)."""
    try:
        pair.pump(lambda: False, "the lost rank's failure")
    except RankFailure as exc:
        assert node.engine.driver is not None and node.engine.driver.failure is not None
        return exc
    raise AssertionError("unreachable: pump returns only by raising")


def _pump_decode(pair: PdPair, until: Callable[[], bool], what: str) -> None:
    """Run decode's loop alone (prefill's stopped with its ranks) until `until()`."""
    for _ in range(MAX_ITERATIONS):
        pair.decode.loop.run_once(idle_poll_ms=1)
        pair._route()
        if until():
            return
    raise AssertionError(f"gave up waiting for {what}")


@pytest.mark.parametrize("lost", ["prefill", "decode"])
def test_a_lost_rank_ends_its_engines_requests_as_an_engine_loss(odd_split_dir: Path, lost: str) -> None:
    """A rank of the TP side killed by its PID while that engine holds a request (prefill: its
    handoff; decode: a request it is decoding): the engine's fail-closed path (what `kvseal engine`
    runs on `RankFailure`) ends it with code `engine_unavailable`, 503 (prefill's refusal, relayed
    by decode as it releases the reservation; decode's own abort output), which the frontend
    answers and audits as an engine loss: 503 `engine_unavailable`, outcome error. Before, prefill
    refused it as `request_aborted` 500 (audited as rejected by the engine) and decode aborted it
    as `request_aborted`. Decode's pages are all free afterwards."""
    sides = (2, 1) if lost == "prefill" else (1, 2)
    pair = PdPair(_args(odd_split_dir, sides[0]), _args(odd_split_dir, sides[1]), kv_transport="tcp-stream")
    try:
        node = pair.prefill if lost == "prefill" else pair.decode
        assert node.engine.driver is not None
        prompt = list(range(60, 90))
        if lost == "prefill":
            handoff = pair.reserve(prompt, GREEDY)
            pair.to_prefill.send(pair.prefill_msg(handoff, prompt, GREEDY))
        else:
            handoff = pair.generate_start(prompt, GREEDY)
            assert handoff.token_ids and not handoff.is_terminal
        os.kill(node.engine.driver.ranks.pids[0], signal.SIGKILL)  # its worker rank (rank 1)
        end_on_rank_failure(node, _until_rank_failure(pair, node))
        if lost == "prefill":
            _pump_decode(pair, lambda: handoff.rejected is not None, "decode's relay of prefill's refusal")
            assert handoff.rejected is not None and isinstance(handoff.prefill_result, PrefillRefusedMsg)
            assert (handoff.prefill_result.code, handoff.rejected.code, handoff.rejected.http_status) == (
                ENGINE_UNAVAILABLE, ENGINE_UNAVAILABLE, 503)
            assert handoff.rejected.message == TP_RANK_LOST
        else:  # decode's loop stopped with its ranks: its last word is already on the way
            while not handoff.is_terminal:
                assert pair.to_decode.socket.poll(WAIT_DEADLINE_S * 1000), "decode's end of the request"
                pair._route()
            assert handoff.is_terminal and handoff.final.finish_reason == "abort"
            assert (handoff.final.error_code, handoff.final.error) == (ENGINE_UNAVAILABLE, TP_RANK_LOST)
        pair.decode.check_integrity()
        assert pair.decode.engine.kv.num_used_pages == 0 and not pair.decode.steps.held()
    finally:
        pair.close()


@pytest.mark.parametrize("stopped", ["prefill", "decode"])
def test_an_engine_told_to_stop_ends_its_requests_as_an_engine_loss(odd_split_dir: Path, stopped: str) -> None:
    """SIGTERM to a `kvseal engine` holding a request (prefill: midway through a chunked prefill;
    decode: decoding): what it runs then (`end_on_shutdown`) ends the request as the engine's
    loss, 503 `engine_unavailable` (prefill's refusal, relayed by decode; decode's own abort
    output), which a client may retry elsewhere. Before, prefill's reached the client as 500
    `request_aborted`, audited as rejected by the engine. Decode's pages are all free afterwards."""
    pair = PdPair(_args(odd_split_dir, 1), _args(odd_split_dir, 1), kv_transport="tcp-stream")
    try:
        node = pair.prefill if stopped == "prefill" else pair.decode
        prompt = list(range(10, 110))  # four prefill chunks of max_num_batched_tokens (32)
        if stopped == "prefill":
            handoff = pair.reserve(prompt, GREEDY)
            pair.to_prefill.send(pair.prefill_msg(handoff, prompt, GREEDY))
            for _ in range(MAX_ITERATIONS):
                pair.prefill.loop.run_once(idle_poll_ms=1)
                if pair.prefill.engine.has_unfinished():
                    break
            assert pair.prefill.engine.has_unfinished(), "prefill took the request"
        else:
            handoff = pair.generate_start(prompt, GREEDY)
            assert handoff.token_ids and not handoff.is_terminal
        end_on_shutdown(node)
        if stopped == "prefill":
            _pump_decode(pair, lambda: handoff.rejected is not None, "decode's relay of prefill's refusal")
            assert handoff.rejected is not None
            assert (handoff.rejected.code, handoff.rejected.http_status) == (ENGINE_UNAVAILABLE, 503)
            assert handoff.rejected.message == "the prefill engine is shutting down"
        else:
            while not handoff.is_terminal:
                assert pair.to_decode.socket.poll(WAIT_DEADLINE_S * 1000), "decode's end of the request"
                pair._route()
            assert (handoff.final.error_code, handoff.final.error) == (ENGINE_UNAVAILABLE,
                                                                       "the decode engine is shutting down")
        pair.decode.check_integrity()
        assert pair.decode.engine.kv.num_used_pages == 0 and not pair.decode.steps.held()
    finally:
        pair.close()
