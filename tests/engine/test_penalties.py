"""Penalties and logit_bias equal a reference implementation of the same formulas.

The reference is transformers' own logits processors where they implement the same formula
(`RepetitionPenaltyLogitsProcessor`, `SequenceBiasLogitsProcessor` for single tokens) and,
for OpenAI's presence/frequency penalties, which transformers does not have, a plain
per-token loop written from OpenAI's definition. Both the batch function (on random logits)
and whole greedy generations (against transformers' `generate` on the same weights) must agree.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from kvseal import SamplingParams
from kvseal.engine.logits_processors import apply_logits_processors
from kvseal.errors import InvalidParameter
from kvseal.types import Request

VOCAB = 64


class OpenAIPenalties(LogitsProcessor):
    """OpenAI: logit -= frequency * count(token in output) + presence * [count > 0]."""

    def __init__(self, presence: float, frequency: float, prompt_len: int) -> None:
        self.presence, self.frequency, self.prompt_len = presence, frequency, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        for row in range(scores.shape[0]):
            for token, count in Counter(input_ids[row, self.prompt_len:].tolist()).items():
                scores[row, token] -= self.frequency * count + self.presence
        return scores


def reference_processors(params: SamplingParams, prompt_len: int) -> LogitsProcessorList:
    processors: list[LogitsProcessor] = []
    if params.logit_bias:
        processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in params.logit_bias}))
    if params.repetition_penalty != 1:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    processors.append(OpenAIPenalties(params.presence_penalty, params.frequency_penalty, prompt_len))
    return LogitsProcessorList(processors)


PARAM_SETS = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.9),
    SamplingParams(presence_penalty=-0.7, frequency_penalty=1.2, repetition_penalty=1.3),
    SamplingParams(logit_bias={5: 3.0, 9: -100.0, 17: 0.5}),
    SamplingParams(logit_bias={3: 2.0}, repetition_penalty=1.4, frequency_penalty=0.4),
    SamplingParams(),
]


def test_batch_function_equals_reference_on_random_logits() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(PARAM_SETS), VOCAB, generator=gen) * 3
    requests = []
    for i, params in enumerate(PARAM_SETS):
        prompt = torch.randint(VOCAB, (5 + i,), generator=gen).tolist()
        request = Request(f"r{i}", "t", prompt, params)
        request.output_token_ids = torch.randint(VOCAB, (3 * i,), generator=gen).tolist()
        requests.append(request)
    ours = apply_logits_processors(logits, requests, eos_token_ids=())
    for row, request in enumerate(requests):
        input_ids = torch.tensor([request.all_token_ids])
        theirs = reference_processors(request.params, request.num_prompt_tokens)(input_ids, logits[row:row + 1])
        torch.testing.assert_close(ours[row], theirs[0], atol=1e-5, rtol=1e-6)
    assert not torch.equal(ours[0], logits[0]), "the penalties changed something"
    assert torch.equal(ours[-1], logits[-1]), "a request without features is untouched"


def test_no_features_returns_the_same_tensor() -> None:
    logits = torch.randn(2, VOCAB)
    requests = [Request("a", "t", [1, 2], SamplingParams()), Request("b", "t", [3], SamplingParams())]
    assert apply_logits_processors(logits, requests, eos_token_ids=()) is logits


PROMPT = list(range(20, 32))
GREEDY_SETS = [
    dict(repetition_penalty=1.8),
    dict(presence_penalty=2.0, frequency_penalty=1.0),
    dict(logit_bias={40: 5.0, 41: 4.0}),
    dict(repetition_penalty=0.7, frequency_penalty=-0.5),
    dict(),
]
MAX_TOKENS = 12


def reference_generate(model_dir: Path, prompt: list[int], params: SamplingParams) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                         do_sample=False, logits_processor=reference_processors(params, len(prompt)))
    return out[0, len(prompt):].tolist()


def test_greedy_generations_equal_transformers_with_the_same_processors(
        make_llm: Callable[..., Any], llama_dir: Path) -> None:
    """One mixed batch (every request with different features) against one reference each."""
    all_params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **kw) for kw in GREEDY_SETS]
    outputs = make_llm().generate([PROMPT] * len(all_params), all_params)
    plain = outputs[-1].token_ids
    for out, params in zip(outputs, all_params):
        assert out.token_ids == reference_generate(llama_dir, PROMPT, params)
    assert len({tuple(o.token_ids) for o in outputs}) > 1 and any(o.token_ids != plain for o in outputs[:-1])
    assert outputs[2].token_ids[0] == 40, "a +5 bias on one token makes the tiny model pick it"


@pytest.mark.parametrize("kwargs, param", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={3: 101.0}), "logit_bias"),
    (dict(n=0), "n"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_bad_values_are_typed_errors(kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_token_ids_outside_the_vocabulary_are_rejected_at_admission(make_llm: Callable[..., Any]) -> None:
    llm = make_llm()
    for params, param in [(SamplingParams(logit_bias={100_000: 1.0}), "logit_bias"),
                          (SamplingParams(stop_token_ids=[512]), "stop_token_ids")]:
        with pytest.raises(InvalidParameter) as info:
            llm.engine.add_request("x", PROMPT, params)
        assert info.value.param == param


# ---- allowed_token_ids (vLLM's): only these tokens are ever sampled ---------------------------

ALLOWED = (7, 11, 13, 300)


def test_only_allowed_tokens_are_sampled(make_llm: Any) -> None:
    """Sampled hot (temperature 2) and greedy, beside a request without the restriction: every
    token is one of the allowed ones, and the unrestricted request is unchanged."""
    llm = make_llm()
    free = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    [alone] = llm.generate([5, 6], free)
    outs = llm.generate([[5, 6], [5, 6], [5, 6]], [
        SamplingParams(max_tokens=12, temperature=2.0, seed=1, ignore_eos=True, allowed_token_ids=list(ALLOWED)),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, allowed_token_ids=list(ALLOWED), logprobs=2),
        free])
    assert all(t in ALLOWED for out in outs[:2] for t in out.token_ids)
    assert len(set(outs[0].token_ids)) > 1, "sampled among them, not one fixed token"
    assert outs[2].token_ids == alone.token_ids
    assert outs[1].logprobs is not None and all(t in ALLOWED for lp in outs[1].logprobs for t, _ in lp.top)
    llm.engine.check_integrity()


def test_an_allowed_set_of_stop_tokens_still_has_a_token_to_sample(make_llm: Any) -> None:
    """Only EOS allowed and min_tokens 5: the ban would leave the row no token at all (NaN); it
    is lifted from such a row, as from a grammar's, so the request samples EOS, goes on to
    min_tokens and ends there."""
    llm = make_llm()
    [out] = llm.generate([5, 6], SamplingParams(max_tokens=8, temperature=1.0, min_tokens=5, allowed_token_ids=[1]))
    assert out.token_ids == [1] * 5 and out.finish_reason.value == "stop"


@pytest.mark.parametrize(("value", "problem"), [([], "non-empty"), ([3, -1], "non-empty"), ([1.5], "non-empty"),
                                                (5, "list of token ids")])
def test_a_bad_allowed_set_is_refused(value: Any, problem: str) -> None:
    with pytest.raises(InvalidParameter, match=problem) as info:
        SamplingParams(allowed_token_ids=value)
    assert info.value.param == "allowed_token_ids"


def test_an_allowed_token_outside_the_vocabulary_is_refused_at_admission(make_llm: Any) -> None:
    llm = make_llm()
    with pytest.raises(InvalidParameter, match="outside the vocabulary") as info:
        llm.generate([5, 6], SamplingParams(allowed_token_ids=[5, VOCAB * 100]))
    assert info.value.param == "allowed_token_ids" and not llm.engine.has_unfinished()
