"""The linears of the ops (`Ops.linear`, `Ops.int8_linear`): kvseal's panels (float32 weights, or
bfloat16-stored for `--quantization bf16`, or int8) and AMX tiles, oneDNN's packing and torch's
int8pack, each giving `nn.Linear`'s result (to the last bits of another sum order) for any row
count and leading shape, and each backend's choice of module for each weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from built_kernels import HAS_TILES, KERNELS, kernels, native_ops, needs_kernels
from torch import nn

from kvseal import ConfigError
from kvseal.models.quant import dequantize_int8, dequantized_weight, quantize_int8
from kvseal.ops import TorchOps
from kvseal.ops.native_kernels import unpack_panels_i8
from kvseal.ops.native_linears import Int8PanelLinear, PanelLinear, SumTileLinear, TileLinear
from kvseal.ops.torch_linears import Int8PackLinear, PackedLinear, SumCopyLinear, onednn_bf16

BF16 = torch.bfloat16


PACKED = (PackedLinear, PanelLinear)


def _make_packed(kind: type[nn.Module], linear: nn.Linear) -> nn.Module:
    if kind is PackedLinear:
        return PackedLinear(linear)
    if KERNELS is None:
        pytest.skip("no C compiler: the native kernels are not built")
    return PanelLinear(linear, KERNELS)


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
    x = torch.randn(rows, 96).to(torch.bfloat16)
    out = TileLinear(linear, kernels())(x)
    expected = F.linear(x, linear.weight, linear.bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n_out)
    assert (out != expected).float().mean().item() < 0.01
    torch.testing.assert_close(out.float(), expected.float(), rtol=2.0**-7, atol=1e-2)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 21, 45, 300])
@pytest.mark.parametrize("n_out", [40, 64])
def test_float32_tile_sums_round_to_the_tile_linear(bias: bool, rows: int, n_out: int, tile_engine: str) -> None:
    """The float32-output tile linear (a TP rank's partial sums) writes the sums the bfloat16
    one rounds: rounded, bit-equal to it; unrounded, the exact products summed in float32."""
    torch.manual_seed(rows + n_out)
    linear = nn.Linear(96, n_out, bias=bias).to(torch.bfloat16)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    module = SumTileLinear(linear, kernels())
    assert not isinstance(module, TileLinear)  # the decode loop and fused gate/up take TileLinears only
    sums = module(x)
    assert sums.dtype == torch.float32 and sums.shape == (rows, n_out)
    assert torch.equal(sums.to(torch.bfloat16), TileLinear(linear, kernels())(x))
    exact = F.linear(x.double(), linear.weight.double(), None if linear.bias is None else linear.bias.double())
    torch.testing.assert_close(sums.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [45, 300])
def test_tile_linear_over_several_weight_groups(rows: int, tile_engine: str) -> None:
    """A weight too large for one thread's L2 group (K = 2,048: 128 KiB a panel pair, 33 pairs,
    the last panel alone) goes in several groups, each passed over by every 32-row chunk with the
    weight tiles streamed: every output is the exact float32 sum, and rounds to the bfloat16
    tile linear's output."""
    torch.manual_seed(rows)
    linear = nn.Linear(2048, 1040, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 2048).to(torch.bfloat16)
    sums = SumTileLinear(linear, kernels())(x)
    exact = F.linear(x.double(), linear.weight.double(), linear.bias.double())
    torch.testing.assert_close(sums.double(), exact, rtol=1e-5, atol=1e-4)
    assert torch.equal(sums.to(torch.bfloat16), TileLinear(linear, kernels())(x))


@pytest.mark.parametrize("native", ["off", "auto"])
def test_each_backend_gives_float32_partial_sums(native: str) -> None:
    """Ops.partial_sum_linear: the tiles' float32 output where the tile linears run (one copy of
    the weight), else a float32 copy; float32 out, unrounded, either way."""
    if native == "auto" and KERNELS is None:
        pytest.skip("no C compiler: the native kernels are not built")
    ops = native_ops() if native == "auto" else TorchOps()
    linear = nn.Linear(64, 24, bias=True).to(torch.bfloat16)
    x = torch.randn(5, 64).to(torch.bfloat16)
    module = ops.partial_sum_linear(linear)
    assert isinstance(module, SumTileLinear if native == "auto" and HAS_TILES else SumCopyLinear)
    exact = F.linear(x.double(), linear.weight.double(), linear.bias.double())
    out = module(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5)


def test_tile_linear_refuses_what_it_cannot_multiply() -> None:
    if KERNELS is None:
        pytest.skip("no C compiler: the native kernels are not built")
    with pytest.raises(TypeError, match="multiple of 32"):
        KERNELS.pack_tiles(torch.zeros(16, 40, dtype=torch.bfloat16))  # a width the tiles cannot step through
    with pytest.raises(TypeError, match="bfloat16"):
        KERNELS.pack_tiles(torch.zeros(16, 64))


@pytest.mark.parametrize("rows", [2, 32, 200])
def test_panel_runs_cover_every_panel_once_for_any_thread_count(rows: int) -> None:
    """The threads take runs of consecutive panels from a shared counter (the run length
    follows the panel count and the thread count): 38 panels, the last partial, split into
    runs that do not divide it, give nn.Linear's result on 1 thread and the same bits on 2
    and 3 (a skipped or doubled panel would not)."""
    if KERNELS is None:
        pytest.skip("no C compiler: the native kernels are not built")
    torch.manual_seed(0)
    linear = nn.Linear(64, 16 * 37 + 5, bias=True)
    packed = PanelLinear(linear, KERNELS)
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


@pytest.mark.parametrize("rows", [1, 4, 13, 130])  # one row reads bf16 directly; more widen each slab once
def test_bf16_panels_equal_a_float32_linear_over_rounded_weights(rows: int) -> None:
    if KERNELS is None:
        pytest.skip("no C compiler: the native kernels are not built")
    torch.manual_seed(rows)
    linear = nn.Linear(72, 40, bias=True)
    panel = PanelLinear(linear, KERNELS, torch.bfloat16)
    assert panel.panels.dtype == torch.bfloat16
    x = torch.randn(rows, 72)
    expected = F.linear(x, linear.weight.to(torch.bfloat16).float(), linear.bias)
    torch.testing.assert_close(panel(x), expected, rtol=1e-5, atol=1e-5)


def _linear(in_features: int, out_features: int, bias: bool, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        linear.weight.normal_(0, 0.08)
        linear.weight[3].zero_()  # an all-zero output channel must not divide by zero
    return linear


# (kvseal's C kernel, or int8pack in a compute dtype; tolerance)
@pytest.mark.parametrize("kernel,tol", [("int8pack-float32", 1e-5), ("int8pack-bfloat16", 2e-2), ("panels", 1e-5)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 32])
def test_int8_linear_matches_the_dequantized_reference(kernel: str, tol: float, bias: bool, rows: int) -> None:
    linear = _linear(96, 40, bias)
    q, scale = quantize_int8(linear.weight)
    if kernel == "panels":
        if KERNELS is None:
            pytest.skip("no C compiler: the native kernels are not built")
        quantized: nn.Module = native_ops().int8_linear(q, scale, linear.bias, torch.float32)
        assert isinstance(quantized, Int8PanelLinear)
    else:
        compute_dtype = torch.float32 if kernel == "int8pack-float32" else torch.bfloat16
        quantized = Int8PackLinear(q, scale, linear.bias, compute_dtype)
    assert torch.equal(quantized.int8_weight(), q)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1))
    expected = F.linear(x, dequantized_weight(quantized), linear.bias)
    out = quantized(x)
    assert out.dtype == x.dtype and out.shape == (rows, 40)
    assert torch.allclose(out, expected, rtol=tol, atol=tol * expected.abs().max().item())
    # any leading shape, as nn.Linear
    assert torch.equal(quantized(x.reshape(1, rows, 96)).reshape(rows, 40), out)


@pytest.mark.parametrize("bias", [False, True])
# below, at and above the kernel's 6-row blocks, past one 96-row block
@pytest.mark.parametrize("rows", [1, 3, 7, 32, 100])
# 40 outputs: two panels, the second partial; 17: the second holds one; 48: full panels, K odd
@pytest.mark.parametrize("n_out,k_in", [(40, 96), (17, 33), (48, 7)])
@needs_kernels
def test_int8_kernel_matches_dequantize_then_linear(bias: bool, rows: int, n_out: int, k_in: int) -> None:
    library = kernels()
    linear = _linear(k_in, n_out, bias, seed=rows)
    q, scale = quantize_int8(linear.weight)
    panels = library.pack_panels_i8(q)
    assert panels.dtype == torch.int8 and panels.shape == ((n_out + 15) // 16, k_in, 16)
    assert torch.equal(unpack_panels_i8(panels, n_out), q)
    assert not panels[-1, :, n_out - (panels.shape[0] - 1) * 16:].any()  # the last panel's padding
    x = torch.randn(rows, k_in, generator=torch.Generator().manual_seed(rows))
    b = None if linear.bias is None else linear.bias.detach()
    expected = F.linear(x, dequantize_int8(q, scale), b)
    out = library.linear_i8(x, panels, scale, b, n_out)
    assert out.dtype == torch.float32 and out.shape == (rows, n_out)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(library.linear_i8(x.reshape(1, rows, k_in), panels, scale, b, n_out).reshape(rows, n_out), out)


@needs_kernels
def test_int8_kernel_refuses_mismatched_inputs() -> None:
    library = kernels()
    q, scale = quantize_int8(_linear(32, 20, bias=False).weight)
    panels = library.pack_panels_i8(q)
    with pytest.raises(TypeError, match="int8 panels hold a 2-D int8 weight"):
        library.pack_panels_i8(q.float())
    with pytest.raises(TypeError, match="float32"):
        library.linear_i8(torch.randn(2, 32).bfloat16(), panels, scale, None, 20)
    with pytest.raises(TypeError, match="float32"):
        library.linear_i8(torch.randn(2, 31), panels, scale, None, 20)
    with pytest.raises(TypeError, match="scales and bias"):
        library.linear_i8(torch.randn(2, 32), panels, scale[:10], None, 20)
    with pytest.raises(TypeError, match="scales and bias"):
        library.linear_i8(torch.randn(2, 32), panels, scale, torch.zeros(20, dtype=torch.float64), 20)


def test_each_backend_picks_its_linear_for_each_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch ops: oneDNN's packing (float32; bfloat16 where oneDNN multiplies it), else the
    linear itself, and no bfloat16-stored float32 weights. The native ops: panels for float32
    (either weight dtype), tiles for bfloat16 where the build runs them and the width is a
    multiple of 32, else the torch ops' choice."""
    f32, bf16 = nn.Linear(64, 40), nn.Linear(64, 40).to(torch.bfloat16)
    odd = nn.Linear(40, 24).to(torch.bfloat16)  # a width the tiles cannot step through
    onednn = torch.backends.mkldnn.is_available()
    assert isinstance(TorchOps().linear(f32, torch.float32), PackedLinear if onednn else nn.Linear)
    assert isinstance(TorchOps().linear(bf16, torch.bfloat16), PackedLinear if onednn_bf16() else nn.Linear)
    assert TorchOps().linear(f32.half(), torch.float16) is not None
    with pytest.raises(ConfigError, match="quantization bf16 needs kvseal's native kernels"):
        TorchOps().linear(nn.Linear(64, 40), torch.bfloat16)
    if KERNELS is None:
        return
    ops = native_ops()
    assert isinstance(ops.linear(nn.Linear(64, 40), torch.float32), PanelLinear)
    assert ops.linear(nn.Linear(64, 40), torch.bfloat16).panels.dtype == torch.bfloat16
    fallback = type(TorchOps().linear(bf16, BF16))
    assert isinstance(ops.linear(bf16, torch.bfloat16), TileLinear if HAS_TILES else fallback)
    assert not isinstance(ops.linear(odd, torch.bfloat16), TileLinear)
