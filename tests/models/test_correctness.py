"""Greedy tokens and logits equal Hugging Face transformers on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import CONFIGS, SCHEDULES
from transformers import AutoModelForCausalLM

from kvseal import LLM, SamplingParams

PROMPTS = [list(range(10, 17)), [40, 41], list(range(100, 160)), [7, 300, 301, 9, 11, 12, 13, 14, 15, 16, 17]]
MAX_TOKENS = 10
LOGPROB_ATOL = 1e-4  # float32 on CPU; differences come from summation order only


def reference(model_dir: Path, prompt: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy generate: token ids and the log-probabilities of each step."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)
    return out.sequences[0, len(prompt):].tolist(), logprobs


@pytest.fixture(scope="module")
def references(tiny_model_dirs: dict[str, Path]) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
    return {arch: [reference(d, p) for p in PROMPTS] for arch, d in tiny_model_dirs.items()}


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=1)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_greedy_matches_transformers(arch: str, schedule: str, tiny_model_dirs: dict[str, Path],
                                     references: dict[str, list[tuple[list[int], torch.Tensor]]]) -> None:
    llm = LLM(str(tiny_model_dirs[arch]), **SCHEDULES[schedule])
    outputs = llm.generate(PROMPTS, GREEDY)
    for out, (ref_ids, ref_logprobs) in zip(outputs, references[arch]):
        assert out.token_ids == ref_ids
        ours = torch.tensor([lp.logprob for lp in out.logprobs])
        theirs = ref_logprobs[torch.arange(len(ref_ids)), torch.tensor(ref_ids)]
        torch.testing.assert_close(ours, theirs, atol=LOGPROB_ATOL, rtol=0)
    if schedule == "preempting":
        assert llm.engine.stats().num_preemptions > 0, "the tiny pool was meant to force preemption"
    llm.engine.check_integrity()
    assert llm.engine.stats().num_pages_used == 0


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_greedy_with_prefix_cache_hits_matches_transformers(arch: str, tiny_model_dirs: dict[str, Path],
                                                             references: dict[str, list[tuple[list[int],
                                                                                              torch.Tensor]]]) -> None:
    """The second pass over the same prompts starts each on its own cached pages."""
    llm = LLM(str(tiny_model_dirs[arch]), **SCHEDULES["chunked"])
    llm.generate(PROMPTS, GREEDY)
    outputs = llm.generate(PROMPTS, GREEDY)
    assert [o.num_cached_tokens for o in outputs] == [(len(p) - 1) // 4 * 4 for p in PROMPTS]
    for out, (ref_ids, ref_logprobs) in zip(outputs, references[arch]):
        assert out.token_ids == ref_ids
        ours = torch.tensor([lp.logprob for lp in out.logprobs])
        theirs = ref_logprobs[torch.arange(len(ref_ids)), torch.tensor(ref_ids)]
        torch.testing.assert_close(ours, theirs, atol=LOGPROB_ATOL, rtol=0)
    llm.engine.check_integrity()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefill_logits_match_at_every_position(arch: str, tiny_model_dirs: dict[str, Path]) -> None:
    """Full-sequence logits from one forward over the paged pool equal transformers' forward."""
    from kvseal.engine.batch import build_forward_batch, check_forward
    from kvseal.types import Request, ScheduledChunk

    llm = LLM(str(tiny_model_dirs[arch]), kv_cache_tokens=256, page_size=4, dtype="float32")
    engine = llm.engine
    prompt = PROMPTS[2]
    request = Request("r", "t", prompt, SamplingParams(max_tokens=1))
    engine.kv.reserve("r", "t", len(prompt))
    prepared = build_forward_batch([ScheduledChunk(request, len(prompt))], engine.kv)
    assert check_forward(prepared, engine.kv) == []
    batch = type(prepared.batch)(**{**prepared.batch.__dict__, "logits_indices": torch.arange(len(prompt))})
    with engine.kv.recording(prepared.writes):
        ours = engine.runner.run(batch).logits
    assert engine.kv.written_prefix("r") == [len(prompt)] * engine.model_config.num_layers
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[arch], dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)


def test_bfloat16_runs_close_to_float32(tiny_model_dirs: dict[str, Path]) -> None:
    """bf16 weights and KV: outputs are well-formed and mostly agree with float32 greedy."""
    model = str(tiny_model_dirs["llama"])
    f32 = LLM(model, kv_cache_tokens=512, page_size=4, dtype="float32").generate(PROMPTS, GREEDY)
    bf16 = LLM(model, kv_cache_tokens=512, page_size=4, dtype="bfloat16").generate(PROMPTS, GREEDY)
    agree = sum(a == b for x, y in zip(f32, bf16) for a, b in zip(x.token_ids, y.token_ids))
    assert all(len(o.token_ids) == MAX_TOKENS for o in bf16)
    assert agree >= 0.5 * MAX_TOKENS * len(PROMPTS)


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_equal_length_prompts_share_one_prefill(arch: str, tiny_model_dirs: dict[str, Path]) -> None:
    """Prompts of equal length prefilled in one step run as one batched causal attention
    call over their own new K/V; each still equals transformers alone."""
    prompts = [list(range(10, 17)), [7, 300, 301, 9, 11, 12, 13], list(range(200, 207))]
    llm = LLM(str(tiny_model_dirs[arch]), **SCHEDULES["batched"])
    outputs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs):
        ref_ids, ref_logprobs = reference(tiny_model_dirs[arch], prompt)
        assert out.token_ids == ref_ids
        ours = torch.tensor([lp.logprob for lp in out.logprobs])
        theirs = ref_logprobs[torch.arange(len(ref_ids)), torch.tensor(ref_ids)]
        torch.testing.assert_close(ours, theirs, atol=LOGPROB_ATOL, rtol=0)
