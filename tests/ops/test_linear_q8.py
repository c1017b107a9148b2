"""The one-row linear over GGUF Q8_0 blocks (`csrc/linear_q8.c`, the lm_head's) against the tile linear over
the bfloat16 weights the loader converts those blocks to (gguf's dequantization, then the cast): every
output and every float32 sum bit-equal on the AVX512-BF16 engine (with and without a bias, output
counts that are not a multiple of 16, several input widths, weights that are rounding ties, the
largest and the subnormal float16 scales, 1-5 threads); on the AMX engine the row kernel declines
(the caller runs the tiles)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from built_kernels import kernels, needs_kernels, needs_tiles, tile_engine  # noqa: F401  (a fixture)

from kvseal.models.gguf_blocks import Q8_0_BLOCK_BYTES, dequantize_rows

pytestmark = needs_kernels
SHAPES = [(40, 64), (333, 576), (7, 32), (1001, 96), (4099, 576), (576, 1536)]  # (n_out, k_in)


def q8_0_blocks(n_out: int, k_in: int, seed: int) -> torch.Tensor:
    """Random GGUF Q8_0 blocks [n_out, k_in / 32, 34] uint8: d float16 of both signs from 1e-6 (some
    subnormal, some flushed to 0) to 1e3, some the largest float16 (65504) and some the smallest
    subnormals (multiples of 2^-24), q every int8 value; two rows whose d * q land exactly halfway
    between two bfloat16 values for q a power of two (ties, which round to even either way); a row
    of subnormal scales alone and one of the largest alone (whose sums no other scale drowns)."""
    rng = np.random.default_rng(seed)
    shape = (n_out, k_in // 32)
    d = (rng.standard_normal(shape) * 10.0 ** rng.integers(-6, 4, shape)).astype(np.float16)
    sign = np.where(rng.random(shape) < 0.5, -1, 1)
    largest, smallest = rng.random(shape) < 0.05, rng.random(shape) < 0.05
    d[largest] = (np.float16(65504) * sign)[largest]
    d[smallest] = (np.float16(2**-24) * rng.integers(1, 4, shape) * sign).astype(np.float16)[smallest]
    q = rng.integers(-128, 128, (*shape, 32)).astype(np.int8)
    d[0] = np.float16(1 + 2**-8)  # q = 1: 1 + 2^-8, a tie that rounds down to 1
    d[1:2] = np.float16(1 + 3 * 2**-8)  # q = 1: a tie that rounds up to 1 + 2^-6
    d[2:3] = (np.float16(2**-24) * rng.integers(1, 1024, shape[1]) * sign[0]).astype(np.float16)  # all subnormal
    d[3:4] = np.float16(65504) * sign[0]  # all the largest
    q[:2, :, ::2] = rng.choice(np.array([1, -1, 2, -2, 4, -4, 64, -128], dtype=np.int8), q[:2, :, ::2].shape)
    blocks = np.zeros((*shape, Q8_0_BLOCK_BYTES), dtype=np.uint8)
    blocks[..., 0:2] = d[..., None].view(np.uint8)
    blocks[..., 2:] = q.view(np.uint8)
    return torch.from_numpy(blocks)


def ties(blocks: torch.Tensor) -> int:
    """How many weights of the blocks are float32 values exactly halfway between two bfloat16."""
    from gguf import GGMLQuantizationType, dequantize

    wide = dequantize(blocks.reshape(blocks.shape[0], -1).numpy(), GGMLQuantizationType.Q8_0).astype(np.float32)
    return int(((wide.view(np.uint32) & 0xFFFF) == 0x8000).sum())


def row(k_in: int, seed: int) -> torch.Tensor:
    return torch.randn(1, k_in, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def tiles_and_blocks(n_out: int, k_in: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiles of the weights the blocks convert to, and the blocks packed for the row kernel."""
    k = kernels()
    blocks = q8_0_blocks(n_out, k_in, seed)
    return k.pack_tiles(dequantize_rows(blocks)), k.pack_q8_0(blocks)


def test_packing_places_every_weights_q_and_scale() -> None:
    """kvseal_pack_q8_0's layout (plain C, every build): feature f of panel p, k-pair j of block b
    at bytes 32 + 32 * j + 2 * f and the next; d at 2 * f; zero past n_out."""
    k = kernels()
    blocks = q8_0_blocks(20, 64, seed=3)
    packed = k.pack_q8_0(blocks)
    assert packed.shape == (2, 2, 544)
    raw = blocks.numpy()
    for n in (0, 7, 8, 15, 16, 19):
        p, f = divmod(n, 16)
        for b in range(2):
            block = packed[p, b].numpy()
            assert block[2 * f:2 * f + 2].tobytes() == raw[n, b, 0:2].tobytes()
            for j in range(16):
                at = 32 + 32 * j + 2 * f
                assert block[at:at + 2].tobytes() == raw[n, b, 2 + 2 * j:4 + 2 * j].tobytes()
    unused = packed[1].numpy().reshape(2, 17, 16, 2)[:, :, 4:]  # features 20-31 (the d "pair" too): zero
    assert not unused.any()


@needs_tiles
def test_the_constructed_blocks_hold_ties_and_extreme_scales() -> None:
    blocks = q8_0_blocks(40, 64, seed=1)
    d = blocks[..., :2].contiguous().view(torch.float16).float()
    assert ties(blocks) > 0
    assert (d.abs() == 65504).any() and ((d != 0) & (d.abs() < 2**-14)).any()  # the largest, and subnormals


@needs_tiles
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n_out, k_in", SHAPES)
def test_row_linear_equals_the_tile_linear(bias: bool, n_out: int, k_in: int, tile_engine: str) -> None:  # noqa: F811
    k = kernels()
    tiles, packed = tiles_and_blocks(n_out, k_in, seed=n_out + k_in)
    b = torch.randn(n_out).to(torch.bfloat16) if bias else None
    x = row(k_in, seed=n_out)
    got = k.linear_q8_0_row(x, packed, b, n_out)
    if tile_engine == "amx":  # declined: the AMX tiles' sums are in another order
        assert got is None
        return
    assert got is not None
    assert torch.equal(got.view(torch.int16), k.linear_tiles(x, tiles, b, n_out).view(torch.int16))


@needs_tiles
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n_out, k_in", SHAPES)
def test_row_sums_equal_the_tile_sums(bias: bool, n_out: int, k_in: int, tile_engine: str) -> None:  # noqa: F811
    """The float32 sums themselves, unrounded (kvseal_linear_q8_0_row_f32 against
    kvseal_linear_tiles_f32): the dequantized weights and the order of the sums, which a rounding
    to bfloat16 mostly hides."""
    k = kernels()
    tiles, packed = tiles_and_blocks(n_out, k_in, seed=n_out * k_in)
    b = torch.randn(n_out) if bias else None
    threads = torch.get_num_threads()
    for seed in range(4):
        x = row(k_in, seed=seed)
        got, want = torch.empty(1, n_out), k.linear_tiles_f32(x, tiles, b, n_out)
        status = k.lib.kvseal_linear_q8_0_row_f32(k.ptr(x), k.ptr(packed), k.ptr(b), k.ptr(got), n_out, k_in, threads)
        if tile_engine == "amx":
            assert status == -1
            return
        assert status == 0 and torch.equal(got.view(torch.int32), want.view(torch.int32))


@needs_tiles
@pytest.mark.parametrize("threads", [1, 2, 3, 4, 5])
def test_every_panel_is_computed_once_for_any_thread_count(threads: int) -> None:
    """The threads claim short runs of panels from a shared counter: every output is written
    (bit-equal to the tiles' sums) whatever the thread count."""
    k = kernels()
    n_out, k_in = 1001, 64
    tiles, packed = tiles_and_blocks(n_out, k_in, seed=threads)
    x = row(k_in, seed=threads)
    want = k.linear_tiles_f32(x, tiles, None, n_out)
    got = torch.full((1, n_out), float("nan"))
    assert k.lib.kvseal_linear_q8_0_row_f32(k.ptr(x), k.ptr(packed), k.NULL, k.ptr(got), n_out, k_in, threads) == 0
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@needs_tiles
def test_row_kernel_refuses_what_it_cannot_read() -> None:
    k = kernels()
    packed = k.pack_q8_0(q8_0_blocks(32, 64, seed=2))
    with pytest.raises(TypeError):
        k.linear_q8_0_row(row(64, 0).repeat(2, 1), packed, None, 32)  # two rows
    with pytest.raises(TypeError):
        k.linear_q8_0_row(row(96, 0), packed, None, 32)  # another width
    with pytest.raises(TypeError):
        k.linear_q8_0_row(row(64, 0), packed, None, 48)  # more outputs than the panels hold
    with pytest.raises(TypeError):
        k.linear_q8_0_row(row(64, 0), k.pack_q4_1(torch.zeros(32, 2, 20, dtype=torch.uint8)), None, 32)  # Q4_1's
