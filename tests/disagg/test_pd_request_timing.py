"""PD: a request's phases for vLLM's histograms come from the engine that lived each one. Prefill
measures the queue (its wait before the request's first prefill step) and the prefill, and sends
them with its commit; decode adds its own decode time and reports all three on the last output."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_harness import PdPair

from kvseal.config import EngineArgs
from kvseal.disagg.decode import _prefill_timing
from kvseal.disagg.msgs import CommitMsg
from kvseal.messages.msgs import RequestTimingMsg
from kvseal.models.loader import load_model
from kvseal.types import RequestTiming, SamplingParams

PARAMS = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def args(llama_dir: Path) -> EngineArgs:
    return EngineArgs(model=str(llama_dir), kv_cache_tokens=256, page_size=4, max_num_batched_tokens=32,
                      dtype="float32", max_model_len=128)


@pytest.fixture
def pair(llama_dir: Path) -> Iterator[PdPair]:
    loaded = load_model(str(llama_dir), args(llama_dir).torch_dtype)
    pd = PdPair(args(llama_dir), args(llama_dir), loaded=loaded)
    yield pd
    pd.close()


def test_the_last_output_has_prefills_queue_and_prefill_and_decodes_decode(pair: PdPair,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    handed: list[RequestTiming | None] = []
    add_prefilled = pair.decode.engine.add_prefilled

    def spying(*a: Any, **kw: Any) -> Any:  # the real call, its prefill figures kept
        handed.append(kw["prefill_timing"] if "prefill_timing" in kw else a[10])
        return add_prefilled(*a, **kw)

    monkeypatch.setattr(pair.decode.engine, "add_prefilled", spying)
    started_s = time.monotonic()
    handoff = pair.generate(list(range(10, 23)), PARAMS)
    elapsed_s = time.monotonic() - started_s
    assert handoff.final.finish_reason == "length" and len(handoff.token_ids) == 5
    assert [o.timing is None for o in handoff.outputs] == [True] * (len(handoff.outputs) - 1) + [False]
    timing = handoff.final.timing
    assert timing is not None and len(handed) == 1 and handed[0] is not None
    assert (timing.queue_s, timing.prefill_s) == (handed[0].queue_s, handed[0].prefill_s), "prefill's own figures"
    assert min(timing.queue_s, timing.prefill_s) >= 0 and timing.decode_s > 0, "four tokens decoded after the first"
    assert timing.queue_s + timing.prefill_s + timing.decode_s <= elapsed_s, "all inside the request's life here"
    pair.assert_clean()


def test_decode_leaves_out_prefill_figures_that_are_no_durations() -> None:
    def commit(timing: RequestTimingMsg | None) -> CommitMsg:
        return CommitMsg("t", "r", "alice", 4, [], 7, None, b"", "prefill-1", prefill_timing=timing)

    assert _prefill_timing(commit(RequestTimingMsg(0.5, 0.25, 0.0))) == RequestTiming(0.5, 0.25, 0.0)
    for bad in (RequestTimingMsg(-1.0, 0.25, 0.0), RequestTimingMsg(0.5, float("nan"), 0.0), None):
        assert _prefill_timing(commit(bad)) is None
