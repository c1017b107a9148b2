"""`prompt_logprobs` (vLLM's): every prompt token's log-probability, its rank and the top
alternatives equal transformers' forward on the same weights, under every schedule (one
batch, chunked prefill, preemption, checked mode), beside other tenants' requests, and never
from a prefix-cache page (a cached page has no logits to give)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import CONFIGS, SCHEDULES
from transformers import AutoModelForCausalLM

from kvseal import LLM, SamplingParams
from kvseal.engine.engine import LLMEngine
from kvseal.errors import InvalidParameter
from kvseal.types import RequestOutput, TokenLogprobs

PROMPTS = [list(range(10, 17)), [40, 41], list(range(100, 160)), [7, 300, 301, 9, 11, 12, 13, 14, 15, 16, 17]]
NUM_TOP = 3
ATOL = 1e-4  # float32 on CPU: summation order only
WITH_PROMPT_LOGPROBS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=NUM_TOP)
PLAIN = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def reference_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i is the log-distribution transformers gives token i + 1."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


@pytest.fixture(scope="module")
def references(tiny_model_dirs: dict[str, Path]) -> dict[str, list[torch.Tensor]]:
    return {arch: [reference_logprobs(d, p) for p in PROMPTS] for arch, d in tiny_model_dirs.items()}


def assert_matches(entries: list[TokenLogprobs | None], prompt: list[int], reference: torch.Tensor) -> None:
    assert len(entries) == len(prompt) and entries[0] is None, "one entry per prompt token, none for the first"
    for position, (entry, expected) in enumerate(zip(entries[1:], reference), start=1):
        assert entry is not None and entry.token_id == prompt[position]
        own = float(expected[entry.token_id])
        assert entry.logprob == pytest.approx(own, abs=ATOL)
        # its rank among all tokens: exact up to near-ties within the tolerance
        assert 1 + int((expected > own + ATOL).sum()) <= entry.rank <= 1 + int((expected > own - ATOL).sum())
        assert len(entry.top) == NUM_TOP
        top_values = torch.tensor([v for _, v in entry.top])
        torch.testing.assert_close(top_values, expected.topk(NUM_TOP).values, atol=ATOL, rtol=0)
        for token, value in entry.top:  # each alternative is that token's value (ties may swap ids)
            assert value == pytest.approx(float(expected[token]), abs=ATOL)


OTHER_PROMPTS = [[(t * 7 + 3) % 500 for t in p] for p in PROMPTS]


@pytest.fixture(scope="module")
def other_references(tiny_model_dirs: dict[str, Path]) -> dict[str, list[torch.Tensor]]:
    return {arch: [reference_logprobs(d, p) for p in OTHER_PROMPTS] for arch, d in tiny_model_dirs.items()}


def run_with_neighbours(engine: LLMEngine, params: SamplingParams) -> dict[str, RequestOutput]:
    """All in the engine at once: PROMPTS with prompt logprobs for tenant alice, other prompts
    with them for bob (a row given to the wrong request shows), and PROMPTS without them for
    carol."""
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"alice-{i}", prompt, params, tenant="alice")
        engine.add_request(f"bob-{i}", OTHER_PROMPTS[i], params, tenant="bob")
        engine.add_request(f"carol-{i}", prompt, PLAIN, tenant="carol")
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    return finished


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_prompt_logprobs_equal_transformers(arch: str, schedule: str, tiny_model_dirs: dict[str, Path],
                                            references: dict[str, list[torch.Tensor]],
                                            other_references: dict[str, list[torch.Tensor]]) -> None:
    llm = LLM(str(tiny_model_dirs[arch]), **SCHEDULES[schedule])
    finished = run_with_neighbours(llm.engine, WITH_PROMPT_LOGPROBS)
    for i, prompt in enumerate(PROMPTS):
        alice, bob, carol = (finished[f"{name}-{i}"] for name in ("alice", "bob", "carol"))
        assert alice.prompt_token_logprobs is not None and bob.prompt_token_logprobs is not None
        assert carol.prompt_token_logprobs is None
        assert_matches(alice.prompt_token_logprobs, prompt, references[arch][i])
        assert_matches(bob.prompt_token_logprobs, OTHER_PROMPTS[i], other_references[arch][i])
        assert alice.token_ids == carol.token_ids, "asking for prompt logprobs does not change what is sampled"
    if schedule == "preempting":
        assert llm.engine.stats().num_preemptions > 0, "the tiny pool was meant to force preemption"
    llm.engine.check_integrity()
    assert llm.engine.stats().num_pages_used == 0


def test_a_request_with_prompt_logprobs_reads_no_cached_page(tiny_model_dirs: dict[str, Path],
                                                             references: dict[str, list[torch.Tensor]]) -> None:
    """A cached page holds KV, not logits: a request that wants its prompt's logprobs computes
    every position itself, and one that does not still starts on the cache."""
    llm = LLM(str(tiny_model_dirs["llama"]), **SCHEDULES["chunked"])
    llm.generate(PROMPTS, PLAIN)  # publishes every prompt's full pages
    again = llm.generate(PROMPTS, WITH_PROMPT_LOGPROBS)
    plain = llm.generate(PROMPTS, PLAIN)
    assert [o.num_cached_tokens for o in again] == [0] * len(PROMPTS)
    assert [o.num_cached_tokens for o in plain] == [(len(p) - 1) // 4 * 4 for p in PROMPTS]
    for out, prompt, reference in zip(again, PROMPTS, references["llama"]):
        assert out.prompt_token_logprobs is not None
        assert_matches(out.prompt_token_logprobs, prompt, reference)
    llm.engine.check_integrity()


def test_offline_prompt_logprobs_come_in_vllms_shape(make_llm: Callable[..., Any]) -> None:
    """`RequestOutput.prompt_logprobs` as vLLM gives it: None for the first token, then per
    position a dict token id -> Logprob, the prompt token first with its rank, the top k ranked
    1..k, each with its decoded text."""
    llm = make_llm(kv_cache_tokens=64, max_model_len=64)
    prompt = [5, 6, 7, 8]
    [out] = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 4
    decode = llm.get_tokenizer().decode
    for position, step in enumerate(out.prompt_logprobs[1:], start=1):
        assert step is not None and next(iter(step)) == prompt[position]
        engine_entry = out.prompt_token_logprobs[position]
        own = step[prompt[position]]
        assert own.logprob == engine_entry.logprob and own.rank == engine_entry.rank
        others = {t: lp for t, lp in step.items() if t != prompt[position]}
        assert sorted(lp.rank for lp in others.values()) == [r for r in (1, 2) if r != own.rank]
        assert all(lp.decoded_token == decode([t]) for t, lp in step.items())
    [plain] = llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0))
    assert plain.prompt_logprobs is None and plain.prompt_token_logprobs is None


def test_a_one_token_prompt_has_one_empty_entry(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(kv_cache_tokens=64, max_model_len=64)
    [out] = llm.generate([9], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=0))
    assert out.prompt_token_logprobs == [None] and out.prompt_logprobs == [None]
    assert len(out.token_ids) == 3


def test_every_choice_carries_the_prompt_logprobs(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(kv_cache_tokens=256, max_model_len=64)
    [out] = llm.generate([5, 6, 7], SamplingParams(max_tokens=2, temperature=1.0, seed=4, n=3, prompt_logprobs=1))
    [alone] = llm.generate([5, 6, 7], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    assert out.prompt_logprobs == alone.prompt_logprobs and len(out.outputs) == 3


@pytest.mark.parametrize("value", [21, -1, 1.5, True, "2"])
def test_prompt_logprobs_out_of_range_or_of_another_type_is_refused(value: object) -> None:
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]
    assert info.value.param == "prompt_logprobs"
