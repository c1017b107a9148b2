"""I1: one admission limit, enforced before any state exists; a rejection is terminal."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvseal import ContextLengthExceeded, InvalidParameter, RequestRejected, SamplingParams
from kvseal.admission import AdmissionLimits, admit, check_context_length

LIMITS = AdmissionLimits(max_model_len=100, kv_cache_tokens=64, vocab_size=512)


def test_limit_is_min_of_context_and_pool() -> None:
    assert LIMITS.max_prompt_tokens == 64
    check_context_length(64, 1, LIMITS)
    with pytest.raises(ContextLengthExceeded) as info:
        check_context_length(65, 1, LIMITS)
    err = info.value
    assert (err.num_prompt_tokens, err.max_model_len, err.kv_cache_tokens) == (65, 100, 64)
    assert "65" in err.message and "64" in err.message and err.code == "context_length_exceeded"
    assert isinstance(err, RequestRejected) and err.http_status == 400


def test_prompt_plus_max_tokens_must_fit_the_context() -> None:
    check_context_length(50, 50, LIMITS)
    with pytest.raises(ContextLengthExceeded, match="101 tokens"):
        check_context_length(50, 51, LIMITS)


def test_truncation_only_when_asked() -> None:
    ids = list(range(10, 90))
    with pytest.raises(ContextLengthExceeded):
        admit(ids, SamplingParams(max_tokens=1), LIMITS)
    assert admit(ids, SamplingParams(max_tokens=1, truncate_prompt_tokens=30), LIMITS) == ids[-30:]


def test_truncate_minus_one_keeps_what_the_limit_admits() -> None:
    """vLLM's truncate_prompt_tokens=-1: cut to the most a prompt may have (here the pool's 64)."""
    ids = list(range(10, 90))
    assert admit(ids, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1), LIMITS) == ids[-64:]
    assert admit(ids[:5], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1), LIMITS) == ids[:5]
    with pytest.raises(InvalidParameter, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=-2)


@pytest.mark.parametrize("prompt", [[], [512], [-1], [3, "x"], [True, 5]])
def test_bad_prompts_are_rejected(prompt: list[Any]) -> None:
    with pytest.raises(InvalidParameter) as info:
        admit(prompt, SamplingParams(), LIMITS)
    assert info.value.param == "prompt"


@pytest.mark.parametrize("kwargs,param", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(min_p=1.5), "min_p"), (dict(min_p=-0.1), "min_p"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(stop=[""]), "stop"),
    (dict(logprobs=21), "logprobs"), (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
])
def test_sampling_params_validate(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and param in info.value.message


@pytest.mark.parametrize("kwargs,param", [
    (dict(max_tokens="4"), "max_tokens"), (dict(max_tokens=1.5), "max_tokens"),
    (dict(top_k=2.5), "top_k"), (dict(min_p="0.1"), "min_p"),
    (dict(n=2.0), "n"), (dict(n=True), "n"), (dict(min_tokens=2.5), "min_tokens"),
    (dict(logprobs=1.5), "logprobs"), (dict(seed=1.5), "seed"), (dict(seed=2**70), "seed"),
    (dict(truncate_prompt_tokens=2.0), "truncate_prompt_tokens"), (dict(temperature="0.5"), "temperature"),
    (dict(top_p=None), "top_p"), (dict(ignore_eos="yes"), "ignore_eos"), (dict(stop=5), "stop"),
    (dict(stop_token_ids=5), "stop_token_ids"), (dict(stop_token_ids=[1.5]), "stop_token_ids"),
    (dict(stop_token_ids=["a"]), "stop_token_ids"), (dict(logit_bias=5), "logit_bias"),
    (dict(logit_bias={"x": 1}), "logit_bias"), (dict(logit_bias={1: "x"}), "logit_bias"),
])
def test_sampling_params_refuse_wrong_types(kwargs: dict[str, Any], param: str) -> None:
    """A value of the wrong type is an InvalidParameter naming the field, not a TypeError from
    a comparison here or from the sampler mid-step (a float top_k or logprobs used to fail
    inside `torch.topk` after the request held pages)."""
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and param in info.value.message


def test_max_tokens_none_is_the_rest_of_the_context(make_llm: Callable[..., Any]) -> None:
    """vLLM's max_tokens=None: generate until the context is full (`finish_reason` length), the
    prompt admitted with room for one token; min_tokens is checked against what is left."""
    llm = make_llm(kv_cache_tokens=64, max_model_len=64)
    free_before = llm.engine.kv.num_free_pages
    params = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    out = llm.generate([list(range(10, 50))], params)[0]
    assert len(out.token_ids) == 64 - 40 and out.finish_reason == "length"
    assert len(llm.generate([list(range(10, 73))], params)[0].token_ids) == 1
    with pytest.raises(ContextLengthExceeded):
        llm.generate([list(range(10, 74))], params)
    with pytest.raises(InvalidParameter) as info:
        llm.generate([list(range(10, 50))], SamplingParams(max_tokens=None, min_tokens=30))
    assert info.value.param == "min_tokens"
    assert not llm.engine.has_unfinished() and llm.engine.kv.num_free_pages == free_before


def test_sampling_params_normalize_numbers() -> None:
    params = SamplingParams(temperature=1, top_p=1, stop="x", stop_token_ids=[7], logit_bias={3: 1})
    assert isinstance(params.temperature, float) and isinstance(params.top_p, float)
    assert (params.stop, params.stop_token_ids, params.logit_bias) == (("x",), (7,), ((3, 1.0),))


def test_engine_rejects_before_any_page_or_queue_entry(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(kv_cache_tokens=64, max_model_len=64)
    engine = llm.engine
    free_before = engine.kv.num_free_pages
    with pytest.raises(ContextLengthExceeded):
        engine.add_request("too-long", list(range(10, 75)), SamplingParams(max_tokens=1))
    with pytest.raises(ContextLengthExceeded):
        engine.add_request("too-long-total", list(range(10, 60)), SamplingParams(max_tokens=15))
    assert engine.kv.num_free_pages == free_before
    assert not engine.has_unfinished() and engine.scheduler.find("too-long") is None
    engine.check_integrity()


def test_offline_generate_rejects_whole_call_and_leaves_nothing_queued(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(kv_cache_tokens=64, max_model_len=64)
    with pytest.raises(ContextLengthExceeded):
        llm.generate([[5, 6, 7], list(range(10, 80))], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.num_used_pages == 0
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))[0].token_ids) == 2
