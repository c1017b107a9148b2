"""Weight-only int8 (`--quantization int8`): the quantization, the swapped model, the flag. The
int8 linears themselves: tests/ops/test_linears.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from built_kernels import KERNELS, native_ops
from torch import nn

from kvseal import ConfigError
from kvseal.cli import main as cli_main
from kvseal.config import EngineArgs
from kvseal.models.loader import load_model
from kvseal.models.quant import dequantize_int8, dequantized_weight, quantize_int8, quantize_model
from kvseal.ops import TorchOps
from kvseal.ops.native_linears import Int8PanelLinear
from kvseal.ops.torch_linears import Int8PackLinear
from kvseal.types import SamplingParams

PROMPT = list(range(20, 32))
OTHERS = [list(range(50, 90)), [7, 8], list(range(120, 133))]
INT8 = (Int8PanelLinear, Int8PackLinear)


def _linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0, 0.08)
        linear.weight[3].zero_()  # an all-zero output channel must not divide by zero
    return linear


def test_quantize_int8_rounds_each_weight_to_within_half_a_step() -> None:
    w = _linear(96, 40, bias=False).weight
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (40,)
    assert int(q.abs().max()) == 127  # the largest weight of a row maps to +-127
    assert torch.all(q[3] == 0) and torch.isfinite(scale).all()
    error = (dequantize_int8(q, scale) - w.float()).abs()
    assert torch.all(error <= scale[:, None] / 2 + 1e-7)


def test_quantize_model_swaps_every_projection_and_is_idempotent(llama_dir: Path) -> None:
    model = load_model(str(llama_dir), torch.float32).model  # as loaded (the engine packs float32 linears)
    reference = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    ops = TorchOps() if KERNELS is None else native_ops()
    quantize_model(model, "int8", ops)
    int8 = {name: m for name, m in model.named_modules() if isinstance(m, INT8)}
    assert set(int8) == set(reference)  # q/k/v, o, gate/up, down in every layer, and the lm_head
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    for name, m in int8.items():
        assert torch.allclose(dequantized_weight(m), reference[name], atol=m.scale.float().max().item())
    again = {name: m for name, m in quantize_model(model, "int8", ops).named_modules() if isinstance(m, INT8)}
    assert all(again[name] is m for name, m in int8.items())
    # float32 model: kvseal's C kernel with the native ops, int8pack with the torch ops
    kind = Int8PackLinear if KERNELS is None else Int8PanelLinear
    assert all(isinstance(m, kind) for m in int8.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_engine_generates_deterministically(make_llm: Callable[..., Any], dtype: str) -> None:
    llm = make_llm(quantization="int8", dtype=dtype)
    assert any(isinstance(m, INT8) for m in llm.engine.runner.model.modules())
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    first = llm.generate([PROMPT], greedy)[0].token_ids
    assert len(first) == 12
    assert llm.generate([PROMPT], greedy)[0].token_ids == first
    assert make_llm(quantization="int8", dtype=dtype).generate([PROMPT], greedy)[0].token_ids == first
    batched = llm.generate([*OTHERS, PROMPT], greedy)
    assert batched[-1].token_ids == first and all(len(o.token_ids) == 12 for o in batched)


def test_int8_logits_stay_close_to_the_unquantized_model(make_llm: Callable[..., Any]) -> None:
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    full = make_llm().generate([PROMPT], params)[0]
    int8 = make_llm(quantization="int8").generate([PROMPT], params)[0]
    assert full.logprobs is not None and int8.logprobs is not None
    full_top, int8_top = dict(full.logprobs[0].top), dict(int8.logprobs[0].top)
    assert int8.token_ids == full.token_ids
    shared = set(full_top) & set(int8_top)
    assert len(shared) >= 3
    assert all(abs(full_top[t] - int8_top[t]) < 0.1 for t in shared)


@pytest.mark.parametrize("bad", ["int4", "INT8", "", "fp8"])
def test_a_bad_quantization_is_a_config_error(bad: str, make_llm: Callable[..., Any]) -> None:
    with pytest.raises(ConfigError, match="quantization must be one of none, int8"):
        EngineArgs(quantization=bad)
    with pytest.raises(ConfigError, match="quantization must be one of"):
        make_llm(quantization=bad)


def test_the_cli_refuses_a_bad_quantization(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["generate", "--quantization", "int3", "hi"]) == 2
    assert "quantization must be one of none, int8, bf16; got 'int3'" in capsys.readouterr().err
