"""Weight-only bfloat16 (`--quantization bf16`): a float32 model whose linear weights are stored
in bfloat16 panels and widened to float32 as they are read. The engine must compute exactly what
transformers computes in float32 with those linear weights rounded to bfloat16."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from built_kernels import KERNELS
from torch import nn
from transformers import AutoModelForCausalLM

from kvseal import ConfigError
from kvseal.config import EngineArgs
from kvseal.ops.native_linears import PanelLinear
from kvseal.types import SamplingParams

pytestmark = pytest.mark.skipif(KERNELS is None, reason="no C compiler: bf16 panels need the native kernels")
PROMPTS = [list(range(20, 32)), list(range(50, 90)), [7, 8]]
MAX_TOKENS = 8


def _rounded_reference(model_dir: Path, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers in float32, every linear weight (and the lm_head) rounded to bfloat16."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(module.weight.to(torch.bfloat16).float())
    out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)
    return out.sequences[0, len(prompt):].tolist(), logprobs


def test_engine_equals_transformers_with_bf16_rounded_linears(make_llm: Callable[..., Any], llama_dir: Path) -> None:
    llm = make_llm(quantization="bf16")
    panels = [m for m in llm.engine.runner.model.modules() if isinstance(m, PanelLinear)]
    assert panels and all(m.panels.dtype == torch.bfloat16 for m in panels)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
    for out, prompt in zip(llm.generate(PROMPTS, params), PROMPTS):
        ids, logprobs = _rounded_reference(llama_dir, prompt)
        assert out.token_ids == ids
        ours = torch.tensor([lp.logprob for lp in out.logprobs])
        torch.testing.assert_close(ours, logprobs[torch.arange(len(ids)), torch.tensor(ids)], atol=1e-4, rtol=0)
    assert llm.engine.stats().num_pages_used == 0


def test_bf16_weights_need_the_native_kernels(make_llm: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError, match="quantization bf16 needs kvseal's native kernels"):
        make_llm(quantization="bf16", native="off")


def test_bf16_weights_need_a_float32_model() -> None:
    with pytest.raises(ConfigError, match="dtype float32"):
        EngineArgs(dtype="bfloat16", quantization="bf16")
    assert EngineArgs(dtype="float32", quantization="bf16").quantization == "bf16"
