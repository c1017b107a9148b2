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


def test_first_token_that_ends_the_request(pair: PdPair, llama_dir: Path) -> None:
    params = SamplingParams(max_tokens=1, temperature=0)
    handoff = pair.generate(PROMPTS[2], params)
    assert handoff.token_ids == colocated(llama_dir, [PROMPTS[2]], params)[0]
    assert handoff.final.finished and handoff.final.finish_reason in ("length", "stop")
    pair.assert_clean()
