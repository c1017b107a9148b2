"""Weight-only bfloat16 (`--quantization bf16`): a float32 model whose linear weights are stored
in bfloat16 panels and widened to float32 as they are read. The engine must compute exactly what
transformers computes in float32 with those linear weights rounded to bfloat16."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM

from kvseal import ConfigError
from kvseal.config import EngineArgs
from kvseal.models.native import native_library
from kvseal.models.packed import PanelLinear
from kvseal.types import SamplingParams

pytestmark = pytest.mark.skipif(native_library() is None, reason="no C compiler: bf16 panels need the native library")
PROMPTS = [list(range(20, 32)), list(range(50, 90)), [7, 8]]
MAX_TOKENS = 8


@pytest.mark.parametrize("rows", [1, 4, 13, 130])  # one row reads bf16 directly; more widen each slab once
def test_bf16_panels_equal_a_float32_linear_over_rounded_weights(rows: int) -> None:
    library = native_library()
    assert library is not None
    torch.manual_seed(rows)
    linear = nn.Linear(72, 40, bias=True)
    panel = PanelLinear(linear, library, torch.bfloat16)
    assert panel.panels.dtype == torch.bfloat16
    x = torch.randn(rows, 72)
    expected = F.linear(x, linear.weight.to(torch.bfloat16).float(), linear.bias)
    torch.testing.assert_close(panel(x), expected, rtol=1e-5, atol=1e-5)


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


def test_bf16_weights_need_a_float32_model() -> None:
    with pytest.raises(ConfigError, match="dtype float32"):
        EngineArgs(dtype="bfloat16", quantization="bf16")
    assert EngineArgs(dtype="float32", quantization="bf16").quantization == "bf16"
