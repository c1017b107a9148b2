"""The PD handoff between two real engines over loopback TCP: it equals colocated generation
token for token, and every step of the protocol fails closed when broken
(docs/ARCHITECTURE.md, "Prefill/decode disaggregation")."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pd_harness import PdPair
from transports import NIXL

from kvseal import LLM, SamplingParams
from kvseal.config import EngineArgs
from kvseal.models.loader import load_model

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [list(range(10, 13)), list(range(40, 48)), list(range(100, 137)), [7], list(range(200, 264))]


def args(llama_dir: Path, **kwargs: Any) -> EngineArgs:
    base: dict[str, Any] = dict(model=str(llama_dir), kv_cache_tokens=512, page_size=4,
                                max_num_batched_tokens=32, dtype="float32", max_model_len=256)
    base.update(kwargs)
    return EngineArgs(**base)


@pytest.fixture(params=["tcp", "tcp-stream", NIXL])
def pair(llama_dir: Path, request: pytest.FixtureRequest) -> Iterator[PdPair]:
    loaded = load_model(str(llama_dir), args(llama_dir).torch_dtype)
    pd = PdPair(args(llama_dir), args(llama_dir), loaded=loaded, kv_transport=request.param)
    yield pd
    pd.close()


def colocated(llama_dir: Path, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    llm = LLM(str(llama_dir), kv_cache_tokens=512, page_size=4, max_num_batched_tokens=32, dtype="float32",
              max_model_len=256)
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_greedy_pd_equals_colocated_token_for_token(pair: PdPair, llama_dir: Path) -> None:
    expected = colocated(llama_dir, PROMPTS, GREEDY)
    for prompt, tokens in zip(PROMPTS, expected):
        handoff = pair.generate(prompt, GREEDY)
        assert handoff.final.finish_reason == "length", handoff.final
        assert handoff.token_ids == tokens
    pair.assert_clean()


def test_concurrent_handoffs_equal_colocated(pair: PdPair, llama_dir: Path) -> None:
    expected = colocated(llama_dir, PROMPTS, GREEDY)
    handoffs = pair.generate_all(PROMPTS, GREEDY)
    assert [h.token_ids for h in handoffs] == expected
    assert pair.decode.link.stats().num_transfers == len(PROMPTS)
    pair.assert_clean()


def test_seeded_sampling_continues_the_same_random_stream(pair: PdPair, llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True, logprobs=2)
    expected = colocated(llama_dir, PROMPTS[:3], params)
    assert [pair.generate(p, params).token_ids for p in PROMPTS[:3]] == expected
    pair.assert_clean()


def test_prompt_logprobs_cross_the_handoff(pair: PdPair, llama_dir: Path) -> None:
    """Prefill computes the prompt's logprobs (reading no cached page) and they reach the
    frontend with decode's first output, equal to colocated generation's."""
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=2)
    llm = LLM(str(llama_dir), kv_cache_tokens=512, page_size=4, max_num_batched_tokens=32, dtype="float32",
              max_model_len=256)
    for prompt in PROMPTS[:3]:
        [expected] = llm.generate(prompt, params)
        handoff = pair.generate(prompt, params)
        assert handoff.token_ids == expected.token_ids
        first, *rest = [o for o in handoff.outputs if o.new_token_ids]
        assert first.prompt_logprobs is not None and all(o.prompt_logprobs is None for o in rest), "sent once"
        assert expected.prompt_token_logprobs is not None and first.prompt_logprobs[0] is None
        assert len(first.prompt_logprobs) == len(prompt)
        for ours, theirs in zip(first.prompt_logprobs[1:], expected.prompt_token_logprobs[1:]):
            assert ours is not None and theirs is not None
            assert (ours.token_id, ours.rank, [t for t, _ in ours.top]) == (theirs.token_id, theirs.rank,
                                                                           [t for t, _ in theirs.top])
            assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-5)
    pair.assert_clean()


def test_first_token_that_ends_the_request(pair: PdPair, llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=1, temperature=0)
    handoff = pair.generate(PROMPTS[2], params)
    assert handoff.token_ids == colocated(llama_dir, [PROMPTS[2]], params)[0]
    assert handoff.final.finished and handoff.final.finish_reason in ("length", "stop")
    pair.assert_clean()
