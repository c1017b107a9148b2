"""What the engine does when an isolation check refuses a sequence, in the default config.

The refused request ends with FinishReason.ABORT, error_code ISOLATION_CHECK_FAILED and a
reason, its pages are freed, an ERROR line is logged and the violation is counted; the other
sequences of the same step still run, and produce what they would have produced anyway.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from kvseal import FinishReason, SamplingParams
from kvseal._testing.faults import Fault, inject
from kvseal.types import ISOLATION_CHECK_FAILED

ALICE = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
BOB = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _alice_with_bob_arriving(llm: Any, fault: bool) -> tuple[list[Any], dict[str, Any]]:
    """alice decodes; bob's prefill joins her in one step, with the placeholder fault or not.
    Returns (the outputs of that shared step, the final output of each request)."""
    engine = llm.engine
    engine.add_request("alice", list(range(10, 22)), ALICE, tenant="alice")
    engine.step()
    engine.add_request("bob", list(range(300, 320)), BOB, tenant="bob")
    finals: dict[str, Any] = {}
    if fault:
        with inject(Fault.PLACEHOLDER_PREFILL):
            shared = engine.step()
    else:
        shared = engine.step()
    finals.update({o.request_id: o for o in shared if o.finished})
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return shared, finals


def test_a_refused_sequence_does_not_stop_the_rest_of_the_batch(
        make_llm: Callable[..., Any], caplog: pytest.LogCaptureFixture) -> None:
    llm = make_llm()
    with caplog.at_level(logging.ERROR, logger="kvseal"):
        shared, finals = _alice_with_bob_arriving(llm, fault=True)
    bob = finals["bob"]
    assert bob.finish_reason is FinishReason.ABORT and bob.error_code == ISOLATION_CHECK_FAILED
    assert bob.error and "never wrote" in bob.error and bob.token_ids == []
    # alice got her token in the very step in which bob was refused, and is unaffected.
    assert {o.request_id for o in shared} == {"alice", "bob"}
    assert [o for o in shared if o.request_id == "alice"][0].new_token_ids
    _, clean = _alice_with_bob_arriving(make_llm(), fault=False)
    assert finals["alice"].finish_reason is FinishReason.LENGTH
    assert finals["alice"].token_ids == clean["alice"].token_ids
    assert clean["bob"].finish_reason is FinishReason.LENGTH
    assert llm.engine.stats().num_isolation_violations == 1
    assert [r.levelno for r in caplog.records if "isolation check failed" in r.getMessage()] == [logging.ERROR]
    assert "bob" in caplog.text
    llm.engine.check_integrity()
    assert llm.engine.kv.num_used_pages == 0


def test_no_false_refusals_across_chunking_and_preemption(make_llm: Callable[..., Any]) -> None:
    """The always-on check must pass every honest forward: chunked prefill, decode, and
    requests that were preempted (their records reset) and recomputed."""
    llm = make_llm(kv_cache_tokens=72, max_model_len=72, max_num_batched_tokens=7)
    prompts = [list(range(50, 90)), [7, 8], list(range(120, 133)), list(range(20, 32))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.num_isolation_violations == 0
    assert all(o.finish_reason is FinishReason.LENGTH for o in outs)
    assert [o.num_kv_tokens_written for o in outs] == [len(p) + 11 for p in prompts]


def test_preemption_forgets_what_the_request_wrote(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(kv_cache_tokens=48, max_model_len=48, max_num_batched_tokens=32)
    engine = llm.engine
    engine.add_request("a", list(range(20, 40)), SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("b", list(range(60, 80)), SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(100):
        if engine.stats().num_preemptions:
            break
        engine.step()
    preempted = list(engine.scheduler.waiting)
    assert preempted and all(engine.kv.written_prefix(r.request_id) == [0, 0] for r in preempted)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats().num_isolation_violations == 0


def test_unseeded_requests_draw_from_the_os_not_the_engine_seed(make_llm: Callable[..., Any]) -> None:
    """Two engines started with the same --seed: unseeded outputs differ (one tenant cannot
    replay another's samples), seeded ones are reproducible."""
    prompt = list(range(20, 32))
    unseeded = SamplingParams(max_tokens=16, temperature=1.5, ignore_eos=True)
    seeded = SamplingParams(max_tokens=16, temperature=1.5, ignore_eos=True, seed=77)
    first, second = make_llm(seed=0), make_llm(seed=0)
    assert first.generate([prompt], unseeded)[0].token_ids != second.generate([prompt], unseeded)[0].token_ids
    assert first.generate([prompt], seeded)[0].token_ids == second.generate([prompt], seeded)[0].token_ids
