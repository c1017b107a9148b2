"""Weight-only int8 (`--quantization int8`): the quantized linear, the swapped model, the flag."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvseal import ConfigError
from kvseal.cli import main as cli_main
from kvseal.config import EngineArgs
from kvseal.models.loader import load_model
from kvseal.models.native import linear_i8, native_library, pack_panels_i8, unpack_panels_i8
from kvseal.models.quant import Int8Linear, dequantize_int8, quantize_int8, quantize_model
from kvseal.types import SamplingParams

PROMPT = list(range(20, 32))
OTHERS = [list(range(50, 90)), [7, 8], list(range(120, 133))]


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


# (compute dtype, kvseal's C kernel or int8pack, tolerance)
@pytest.mark.parametrize("compute_dtype,native,tol", [(torch.float32, False, 1e-5), (torch.bfloat16, False, 2e-2),
                                                      (torch.float32, True, 1e-5)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 32])
def test_int8_linear_matches_the_dequantized_reference(compute_dtype: torch.dtype, native: bool, tol: float,
                                                       bias: bool, rows: int) -> None:
    linear = _linear(96, 40, bias)
    quantized = Int8Linear(linear, compute_dtype, _library() if native else None)
    assert (quantized.library is not None) == native
    assert torch.equal(quantized.int8_weight(), quantize_int8(linear.weight)[0])
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1))
    expected = F.linear(x, quantized.dequantized_weight(), linear.bias)
    out = quantized(x)
    assert out.dtype == x.dtype and out.shape == (rows, 40)
    assert torch.allclose(out, expected, rtol=tol, atol=tol * expected.abs().max().item())
    # any leading shape, as nn.Linear
    assert torch.equal(quantized(x.reshape(1, rows, 96)).reshape(rows, 40), out)


def test_quantize_model_swaps_every_projection_and_is_idempotent(llama_dir: Path) -> None:
    model = load_model(str(llama_dir), torch.float32).model  # as loaded (the engine packs float32 linears)
    reference = {name: m.weight.detach().clone() for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    quantize_model(model, "int8")
    int8 = {name: m for name, m in model.named_modules() if isinstance(m, Int8Linear)}
    assert set(int8) == set(reference)  # q/k/v, o, gate/up, down in every layer, and the lm_head
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    for name, m in int8.items():
        assert torch.allclose(m.dequantized_weight(), reference[name], atol=m.scale.float().max().item())
    again = {name: m for name, m in quantize_model(model, "int8").named_modules() if isinstance(m, Int8Linear)}
    assert all(again[name] is m for name, m in int8.items())
    # float32 model: kvseal's C kernel when the library builds, int8pack without it
    assert all((m.library is not None) == (native_library() is not None) for m in int8.values())


def _library() -> Any:
    library = native_library()
    if library is None:
        pytest.skip("no C compiler: the native library is not built")
    return library


@pytest.mark.parametrize("bias", [False, True])
# below, at and above the kernel's 6-row blocks, past one 96-row block
@pytest.mark.parametrize("rows", [1, 3, 7, 32, 100])
# 40 outputs: two panels, the second partial; 17: the second holds one; 48: full panels, K odd
@pytest.mark.parametrize("n_out,k_in", [(40, 96), (17, 33), (48, 7)])
def test_int8_kernel_matches_dequantize_then_linear(bias: bool, rows: int, n_out: int, k_in: int) -> None:
    library = _library()
    linear = _linear(k_in, n_out, bias, seed=rows)
    q, scale = quantize_int8(linear.weight)
    panels = pack_panels_i8(library, q)
    assert panels.dtype == torch.int8 and panels.shape == ((n_out + 15) // 16, k_in, 16)
    assert torch.equal(unpack_panels_i8(panels, n_out), q)
    assert not panels[-1, :, n_out - (panels.shape[0] - 1) * 16:].any()  # the last panel's padding
    x = torch.randn(rows, k_in, generator=torch.Generator().manual_seed(rows))
    b = None if linear.bias is None else linear.bias.detach()
    expected = F.linear(x, dequantize_int8(q, scale), b)
    out = linear_i8(library, x, panels, scale, b, n_out)
    assert out.dtype == torch.float32 and out.shape == (rows, n_out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(linear_i8(library, x.reshape(1, rows, k_in), panels, scale, b, n_out).reshape(rows, n_out), out)


def test_int8_kernel_refuses_mismatched_inputs() -> None:
    library = _library()
    q, scale = quantize_int8(_linear(32, 20, bias=False).weight)
    panels = pack_panels_i8(library, q)
    with pytest.raises(TypeError, match="int8 panels hold a 2-D int8 weight"):
        pack_panels_i8(library, q.float())
    with pytest.raises(TypeError, match="float32"):
        linear_i8(library, torch.randn(2, 32).bfloat16(), panels, scale, None, 20)
    with pytest.raises(TypeError, match="float32"):
        linear_i8(library, torch.randn(2, 31), panels, scale, None, 20)
    with pytest.raises(TypeError, match="scales and bias"):
        linear_i8(library, torch.randn(2, 32), panels, scale[:10], None, 20)
    with pytest.raises(TypeError, match="scales and bias"):
        linear_i8(library, torch.randn(2, 32), panels, scale, torch.zeros(20, dtype=torch.float64), 20)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_engine_generates_deterministically(make_llm: Callable[..., Any], dtype: str) -> None:
    llm = make_llm(quantization="int8", dtype=dtype)
    assert any(isinstance(m, Int8Linear) for m in llm.engine.runner.model.modules())
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
