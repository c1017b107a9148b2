"""The offline API (`kvseal.llm.LLM`) as a vLLM user calls it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvseal import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def test_a_failing_step_leaves_the_engine_clean_and_usable(make_llm: Callable[..., Any],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that raises mid-call (here the model runner) aborts the call's requests: no page
    stays held and the next call runs (before, the requests stayed queued and the next
    call could step them forever)."""
    llm = make_llm(kv_cache_tokens=64, max_model_len=64)
    free_before = llm.engine.kv.num_free_pages
    expected = llm.generate([[5, 6, 7]], GREEDY)[0].token_ids
    run = llm.engine.runner.run

    def fail_once(batch: Any) -> Any:
        monkeypatch.setattr(llm.engine.runner, "run", run)
        raise RuntimeError("test: the forward failed")

    monkeypatch.setattr(llm.engine.runner, "run", fail_once)
    with pytest.raises(RuntimeError, match="the forward failed"):
        llm.generate([[5, 6, 7], [8, 9]], GREEDY)
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.num_free_pages == free_before
    llm.engine.check_integrity()
    assert llm.generate([[5, 6, 7]], GREEDY)[0].token_ids == expected
