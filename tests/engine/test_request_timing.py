"""A request's phases (`RequestTiming`, for vLLM's histograms) as the engine measures them: a
preemption keeps the first schedule and the first token, as vLLM's does, so the wait and the
recompute after one count in decode, never in the queue."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvseal import SamplingParams
from kvseal.types import RequestOutput, RequestTiming

PARAMS = SamplingParams(max_tokens=20, ignore_eos=True)


def test_a_preempted_request_keeps_its_first_schedule_and_first_token(make_llm: Callable[..., Any]) -> None:
    engine = make_llm(kv_cache_tokens=48, max_model_len=48, max_num_batched_tokens=32).engine
    requests = [engine.add_request(rid, list(range(start, start + 20)), PARAMS)
                for rid, start in (("a", 20), ("b", 60))]
    finals: list[RequestOutput] = []
    for _ in range(200):
        if engine.stats().num_preemptions:
            break
        finals += [o for o in engine.step() if o.finished]
    preempted = list(engine.scheduler.waiting)
    assert preempted and all(r.first_token_s is not None for r in preempted), "preempted while decoding"
    marks = {r.request_id: (r.arrival_s, r.first_scheduled_s, r.first_token_s) for r in requests}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        finals += [o for o in engine.step() if o.finished]
    assert sorted(o.request_id for o in finals) == ["a", "b"]
    for out in finals:
        arrival_s, scheduled_s, first_token_s = marks[out.request_id]
        assert scheduled_s is not None and first_token_s is not None and out.timing is not None
        assert (out.timing.queue_s, out.timing.prefill_s) == (scheduled_s - arrival_s, first_token_s - scheduled_s)
        assert out.timing.decode_s > 0 and out.timing.inference_s == out.timing.prefill_s + out.timing.decode_s


def test_outputs_before_the_last_and_requests_ended_before_a_token_have_no_phases(
        make_llm: Callable[..., Any]) -> None:
    engine = make_llm().engine
    engine.add_request("queued", [5, 6, 7], PARAMS)
    aborted = engine.abort("queued")
    assert aborted is not None and aborted.finished and aborted.timing is None
    engine.add_request("runs", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    outputs = []
    for _ in range(20):
        if not engine.has_unfinished():
            break
        outputs += engine.step()
    assert [o.timing is None for o in outputs] == [True, True, False]
    assert isinstance(outputs[-1].timing, RequestTiming) and min(
        outputs[-1].timing.queue_s, outputs[-1].timing.prefill_s, outputs[-1].timing.decode_s) >= 0
