"""Packing a model's linears (`pack_model`: kvseal's panels or oneDNN's packing in float32,
kvseal's AMX tiles or oneDNN's packing in bfloat16, by the engine's ops): every linear and the
lm_head swapped, the float32 and bfloat16 engines use them, quantized models do not, a tied
lm_head leaves the embedding table in place, and the packed engine generates what the unpacked
model does. The linears themselves: tests/ops/test_linears.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from built_kernels import HAS_TILES, KERNELS, native_ops
from torch import nn

from kvseal.models.loader import load_model
from kvseal.models.packed import pack_model
from kvseal.ops import TorchOps
from kvseal.ops.native_linears import Int8PanelLinear, PanelLinear, TileLinear
from kvseal.ops.torch_linears import Int8PackLinear, PackedLinear, onednn_bf16
from kvseal.types import SamplingParams


def test_pack_model_swaps_every_float32_linear_and_keeps_the_tied_embedding(llama_dir: Path) -> None:
    model = load_model(str(llama_dir), torch.float32).model
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    embedding = model.model.embed_tokens.weight.detach().clone()
    ops = TorchOps() if KERNELS is None else native_ops()
    pack_model(model, ops)
    kind = PackedLinear if KERNELS is None else PanelLinear
    packed = {name for name, m in model.named_modules() if isinstance(m, kind)}
    assert packed == linears and not any(isinstance(m, nn.Linear) for m in model.modules())
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    again = pack_model(model, ops)  # packing twice is harmless
    assert {name for name, m in again.named_modules() if isinstance(m, kind)} == packed


@pytest.mark.parametrize("native", ["auto", "off"])
def test_only_unquantized_float32_and_bfloat16_are_packed(make_llm: Callable[..., Any], native: str) -> None:
    """float32: panels (native ops) or oneDNN; bfloat16: tiles where the native build runs them,
    else oneDNN where it multiplies bfloat16; int8 never."""
    native_linears = native == "auto" and KERNELS is not None
    modules = {dtype: list(make_llm(dtype=dtype, native=native).engine.runner.model.modules())
               for dtype in ("float32", "bfloat16")}
    f32_kind = PanelLinear if native_linears else PackedLinear if torch.backends.mkldnn.is_available() else nn.Linear
    assert any(isinstance(m, f32_kind) for m in modules["float32"])
    bf16_kind = TileLinear if native_linears and HAS_TILES else PackedLinear if onednn_bf16() else nn.Linear
    assert any(isinstance(m, bf16_kind) for m in modules["bfloat16"])
    assert not any(isinstance(m, PanelLinear) for m in modules["bfloat16"])
    int8 = list(make_llm(quantization="int8", native=native).engine.runner.model.modules())
    assert any(isinstance(m, (Int8PanelLinear, Int8PackLinear)) for m in int8)
    assert not any(isinstance(m, (PackedLinear, PanelLinear)) for m in int8)


def test_packed_engine_equals_the_unpacked_model(make_llm: Callable[..., Any], llama_dir: Path) -> None:
    """Greedy tokens and logprobs of the packed engine against the same engine without packing."""
    prompts = [list(range(20, 32)), list(range(50, 90)), [7, 8]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    packed = make_llm().generate(prompts, params)
    unpacked_llm = make_llm()
    unpacked_llm.engine.runner.model = load_model(str(llama_dir), torch.float32).model
    unpacked = unpacked_llm.generate(prompts, params)
    for a, b in zip(packed, unpacked):
        assert a.token_ids == b.token_ids
        assert a.logprobs is not None and b.logprobs is not None
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in a.logprobs]),
                                   torch.tensor([lp.logprob for lp in b.logprobs]), rtol=0, atol=1e-4)


def test_without_panels_the_model_holds_onednn_packed_weights(llama_dir: Path) -> None:
    """The fallback packing (no C compiler) still swaps every linear."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN: no fallback packing")
    model = load_model(str(llama_dir), torch.float32).model
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    pack_model(model, TorchOps())
    assert {name for name, m in model.named_modules() if isinstance(m, PackedLinear)} == linears
