"""Packed linears (kvseal's panels or oneDNN's packing in float32, kvseal's AMX tiles or oneDNN's
packing in bfloat16): same results as `nn.Linear` (to the last bits of another sum order) for any
row count and leading shape;
the float32 and bfloat16 engines use them, quantized models do not; a tied lm_head leaves the
embedding table in place."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvseal.models.loader import load_model
from kvseal.models.native import native_library
from kvseal.models.packed import PackedLinear, PanelLinear, TileLinear, can_pack, onednn_bf16, pack_model, tile_library
from kvseal.models.quant import Int8Linear
from kvseal.types import SamplingParams

PACKED = (PackedLinear, PanelLinear)


def _make_packed(kind: type[nn.Module], linear: nn.Linear) -> nn.Module:
    if kind is PackedLinear:
        return PackedLinear(linear)
    library = native_library()
    if library is None:
        pytest.skip("no C compiler: the native library is not built")
    return PanelLinear(linear, library)


@pytest.mark.parametrize("kind", PACKED)
@pytest.mark.parametrize("bias", [False, True])
# below, at and above oneDNN's packing row count; the panels' row blocks are 96 rows, each split
# into passes of at most 6 rows, nearly equal (8 = 4 + 4, 13 = 5 + 4 + 4, 100 = 96 + 4)
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 32, 100, 513])
# 40 outputs: two panels, the second partial; 96 inputs
def test_packed_linear_matches_nn_linear(kind: type[nn.Module], bias: bool, rows: int) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=bias)
    packed = _make_packed(kind, linear)
    x = torch.randn(rows, 96)
    expected = F.linear(x, linear.weight, linear.bias)
    out = packed(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 40)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed(x.reshape(1, rows, 96)).reshape(rows, 40), out, rtol=0, atol=0)


@pytest.mark.skipif(not onednn_bf16(), reason="oneDNN does not multiply bfloat16 on this CPU")
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 32, 513])
def test_packed_bfloat16_linear_equals_f_linear(bias: bool, rows: int) -> None:
    """oneDNN's packed bfloat16 weight gives what F.linear gives (oneDNN's bfloat16 kernel either way)."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    out = PackedLinear(linear)(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 40)
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias), rtol=2.0**-7, atol=1e-3)


@pytest.mark.parametrize("bias", [False, True])
# one row tile, two, a partial second, more than one 32-row chunk, more than one 256-row block;
# 2, 3, 7: the dot-product engine's row blocks of every size (it blocks rows by 8)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 21, 45, 300])
# 40 outputs: three panels (the last partial), an odd count: a thread's last panel has no pair
@pytest.mark.parametrize("n_out", [40, 64])
def test_tile_linear_matches_f_linear(bias: bool, rows: int, n_out: int, tile_engine: str) -> None:
    """float32 sums over the tiles (on AMX or AVX512-BF16), rounded once: F.linear's bfloat16
    result but for an output rounded the other way by a different order of the sums."""
    torch.manual_seed(rows)
    linear = nn.Linear(96, n_out, bias=bias).to(torch.bfloat16)
    library = tile_library()
    assert library is not None
    x = torch.randn(rows, 96).to(torch.bfloat16)
    out = TileLinear(linear, library)(x)
    expected = F.linear(x, linear.weight, linear.bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n_out)
    assert (out != expected).float().mean().item() < 0.01
    torch.testing.assert_close(out.float(), expected.float(), rtol=2.0**-7, atol=1e-2)


def test_tile_linear_refuses_what_it_cannot_multiply() -> None:
    from kvseal.models.native import pack_tiles

    library = native_library()
    if library is None:
        pytest.skip("no C compiler: the native library is not built")
    with pytest.raises(TypeError, match="multiple of 32"):
        pack_tiles(library, torch.zeros(16, 40, dtype=torch.bfloat16))  # a width the tiles cannot step through
    with pytest.raises(TypeError, match="bfloat16"):
        pack_tiles(library, torch.zeros(16, 64))


@pytest.mark.parametrize("rows", [2, 32, 200])
def test_panel_runs_cover_every_panel_once_for_any_thread_count(rows: int) -> None:
    """The threads take runs of consecutive panels from a shared counter (the run length
    follows the panel count and the thread count): 38 panels, the last partial, split into
    runs that do not divide it, give nn.Linear's result on 1 thread and the same bits on 2
    and 3 (a skipped or doubled panel would not)."""
    library = native_library()
    if library is None:
        pytest.skip("no C compiler: the native library is not built")
    torch.manual_seed(0)
    linear = nn.Linear(64, 16 * 37 + 5, bias=True)
    packed = PanelLinear(linear, library)
    x = torch.randn(rows, 64)
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(packed(x))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(outs[0], F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


def test_pack_model_swaps_every_float32_linear_and_keeps_the_tied_embedding(llama_dir: Path) -> None:
    model = load_model(str(llama_dir), torch.float32).model
    linears = {name for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    embedding = model.model.embed_tokens.weight.detach().clone()
    pack_model(model)
    kind = PackedLinear if native_library() is None else PanelLinear
    packed = {name for name, m in model.named_modules() if isinstance(m, kind)}
    assert packed == linears and not any(isinstance(m, nn.Linear) for m in model.modules())
    assert torch.equal(model.model.embed_tokens.weight, embedding)
    again = pack_model(model)  # packing twice is harmless
    assert {name for name, m in again.named_modules() if isinstance(m, kind)} == packed


def test_only_unquantized_float32_and_bfloat16_are_packed(make_llm: Callable[..., Any]) -> None:
    """float32: panels or oneDNN; bfloat16: oneDNN only, where it multiplies bfloat16; int8 never."""
    assert can_pack(torch.float32, "none") == (native_library() is not None or torch.backends.mkldnn.is_available())
    assert can_pack(torch.bfloat16, "none") == onednn_bf16()
    assert not can_pack(torch.float32, "int8") and not can_pack(torch.bfloat16, "int8")
    modules = {dtype: list(make_llm(dtype=dtype).engine.runner.model.modules()) for dtype in ("float32", "bfloat16")}
    assert any(isinstance(m, PACKED) for m in modules["float32"]) == can_pack(torch.float32, "none")
    bf16_kind = TileLinear if tile_library() is not None else PackedLinear if onednn_bf16() else nn.Linear
    assert any(isinstance(m, bf16_kind) for m in modules["bfloat16"])
    assert not any(isinstance(m, PanelLinear) for m in modules["bfloat16"])
    int8 = list(make_llm(quantization="int8").engine.runner.model.modules())
    assert any(isinstance(m, Int8Linear) for m in int8) and not any(isinstance(m, PACKED) for m in int8)


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
    pack_model(model, panels=False)
    assert {name for name, m in model.named_modules() if isinstance(m, PackedLinear)} == linears
