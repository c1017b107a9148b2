"""The one-row linears over GGUF Q4_1 blocks (`csrc/linear_q4.c`) against the tile linears over the
bfloat16 weights the loader converts those blocks to (gguf's dequantization, then the cast): every
output bit-equal on the AVX512-BF16 engine (plain, with a bias, the o_proj/down_proj's fused
add + RMSNorm as the decode loop composes it, the gate/up's fused SiLU; widths that are not a
multiple of 16); on the AMX engine the row kernels decline (the caller runs the tiles)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from built_kernels import kernels, needs_kernels, needs_tiles, tile_engine  # noqa: F401  (a fixture)

from kvseal.models.gguf_blocks import Q4_1_BLOCK_BYTES, dequantize_rows

pytestmark = needs_kernels
FEATURE_BYTE = [0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15]  # feature -> its byte of a packed k-pair


def q4_1_blocks(n_out: int, k_in: int, seed: int) -> torch.Tensor:
    """Random GGUF Q4_1 blocks [n_out, k_in / 32, 20] uint8: d and m float16 of both signs and
    several magnitudes, some m exactly 0, random nibbles; and rows whose d * q + m lands exactly
    halfway between two bfloat16 values (ties, which round to even either way)."""
    rng = np.random.default_rng(seed)
    blocks = np.zeros((n_out, k_in // 32, Q4_1_BLOCK_BYTES), dtype=np.uint8)
    shape = blocks.shape[:2]
    d = (rng.standard_normal(shape) * 10.0 ** rng.integers(-4, 1, shape)).astype(np.float16)
    m = (rng.standard_normal(shape) * 10.0 ** rng.integers(-4, 1, shape)).astype(np.float16)
    m[rng.random(shape) < 0.2] = 0
    d[0], m[0] = np.float16(1 + 2**-8), np.float16(0)  # q = 1: 1 + 2^-8, a tie that rounds down to 1
    if n_out > 1:
        d[1], m[1] = np.float16(1 + 3 * 2**-8), np.float16(0)  # q = 1: a tie that rounds up to 1 + 2^-6
    blocks[..., 0:2] = d[..., None].view(np.uint8)
    blocks[..., 2:4] = m[..., None].view(np.uint8)
    blocks[..., 4:] = rng.integers(0, 256, (*shape, 16), dtype=np.uint8)
    return torch.from_numpy(blocks)


def ties(blocks: torch.Tensor) -> int:
    """How many weights of the blocks are float32 values exactly halfway between two bfloat16."""
    from gguf import GGMLQuantizationType, dequantize

    wide = dequantize(blocks.reshape(blocks.shape[0], -1).numpy(), GGMLQuantizationType.Q4_1).astype(np.float32)
    return int(((wide.view(np.uint32) & 0xFFFF) == 0x8000).sum())


def row(k_in: int, seed: int) -> torch.Tensor:
    return torch.randn(1, k_in, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_packing_places_every_weights_nibble_scale_and_offset() -> None:
    """kvseal_pack_q4_1's layout (plain C, every build): feature f of panel p, k-pair j of block b
    at its byte (FEATURE_BYTE) and nibble; d and m at f; zero past n_out."""
    k = kernels()
    blocks = q4_1_blocks(20, 64, seed=3)
    packed = k.pack_q4_1(blocks)
    assert packed.shape == (2, 2, 320)
    raw = blocks.numpy()
    for n in (0, 7, 15, 16, 19):
        p, f = divmod(n, 16)
        for b in range(2):
            block = packed[p, b].numpy()
            assert block[2 * f:2 * f + 2].tobytes() == raw[n, b, 0:2].tobytes()
            assert block[32 + 2 * f:34 + 2 * f].tobytes() == raw[n, b, 2:4].tobytes()
            for j in range(32):
                q = raw[n, b, 4 + j % 16] >> (4 * (j // 16)) & 15
                assert block[64 + 16 * (j // 2) + FEATURE_BYTE[f]] >> (4 * (j % 2)) & 15 == q
    unused = [FEATURE_BYTE[f] for f in range(4, 16)]  # features 20-31: zero
    assert not packed[1, :, 64:].numpy().reshape(2, 16, 16)[:, :, unused].any()


@needs_tiles
def test_the_constructed_blocks_hold_ties() -> None:
    assert ties(q4_1_blocks(40, 64, seed=1)) > 0


@needs_tiles
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n_out, k_in", [(40, 64), (960, 576), (576, 1536), (7, 32)])
def test_row_linear_equals_the_tile_linear(bias: bool, n_out: int, k_in: int, tile_engine: str) -> None:  # noqa: F811
    k = kernels()
    blocks = q4_1_blocks(n_out, k_in, seed=n_out + k_in)
    tiles, packed = k.pack_tiles(dequantize_rows(blocks)), k.pack_q4_1(blocks)
    b = torch.randn(n_out).to(torch.bfloat16) if bias else None
    x = row(k_in, seed=n_out)
    got = k.linear_q4_1_row(x, packed, b, n_out)
    if tile_engine == "amx":  # declined: the AMX tiles' sums are in another order
        assert got is None
        return
    assert got is not None
    assert torch.equal(got, k.linear_tiles(x, tiles, b, n_out))


@needs_tiles
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n_out, k_in", [(40, 64), (960, 576), (576, 1536), (7, 32)])
def test_row_sums_equal_the_tile_sums(bias: bool, n_out: int, k_in: int, tile_engine: str) -> None:  # noqa: F811
    """The float32 sums themselves, unrounded (kvseal_linear_q4_1_row_f32 against
    kvseal_linear_tiles_f32): the dequantized weights and the order of the sums, which a rounding
    to bfloat16 mostly hides (an order of 4 accumulators instead of 8 passes most bfloat16 checks)."""
    k = kernels()
    blocks = q4_1_blocks(n_out, k_in, seed=n_out * k_in)
    tiles, packed = k.pack_tiles(dequantize_rows(blocks)), k.pack_q4_1(blocks)
    b = torch.randn(n_out) if bias else None
    threads = torch.get_num_threads()
    for seed in range(4):
        x = row(k_in, seed=seed)
        got, want = torch.empty(1, n_out), k.linear_tiles_f32(x, tiles, b, n_out)
        status = k.lib.kvseal_linear_q4_1_row_f32(k.ptr(x), k.ptr(packed), k.ptr(b), k.ptr(got), n_out, k_in, threads)
        if tile_engine == "amx":
            assert status == -1
            return
        assert status == 0 and torch.equal(got, want)


@needs_tiles
@pytest.mark.parametrize("threads", [1, 3, 5])
def test_every_panel_is_computed_once_for_any_thread_count(threads: int) -> None:
    """The threads claim short runs of panels from a shared counter: every output is written
    (bit-equal to the tiles' sums) whatever the thread count."""
    k = kernels()
    n_out, k_in = 1000, 64
    blocks = q4_1_blocks(n_out, k_in, seed=threads)
    tiles, packed = k.pack_tiles(dequantize_rows(blocks)), k.pack_q4_1(blocks)
    x = row(k_in, seed=threads)
    want = k.linear_tiles_f32(x, tiles, None, n_out)
    got = torch.full((1, n_out), float("nan"))
    assert k.lib.kvseal_linear_q4_1_row_f32(k.ptr(x), k.ptr(packed), k.NULL, k.ptr(got), n_out, k_in, threads) == 0
    assert torch.equal(got, want)


@needs_tiles
@pytest.mark.parametrize("inter, k_in", [(32, 64), (1536, 576)])
def test_row_silu_equals_the_fused_tile_silu(inter: int, k_in: int, tile_engine: str) -> None:  # noqa: F811
    k = kernels()
    blocks = q4_1_blocks(2 * inter, k_in, seed=inter)
    tiles, packed = k.pack_tiles(dequantize_rows(blocks)), k.pack_q4_1(blocks)
    x = row(k_in, seed=inter)
    got = k.linear_silu_q4_1_row(x, packed, inter)
    if tile_engine == "amx":
        assert got is None
        return
    assert got is not None
    assert torch.equal(got, k.linear_silu(x, tiles, None, inter))


@needs_tiles
def test_row_silu_declines_an_intermediate_width_not_a_multiple_of_16() -> None:
    k = kernels()
    blocks = q4_1_blocks(2 * 24, 64, seed=5)
    assert k.linear_silu_q4_1_row(row(64, seed=5), k.pack_q4_1(blocks), 24) is None


@needs_tiles
@pytest.mark.parametrize("bias", [False, True])
def test_row_linear_then_add_norm_equals_the_fused_tile_add_norm(bias: bool, tile_engine: str) -> None:  # noqa: F811
    """The decode loop's o_proj / down_proj at one row: the row linear, then the residual add and
    RMSNorm (loop_tiles_add_norm), against kvseal_linear_tiles_add_norm_bf16."""
    k = kernels()
    n_out, k_in = 576, 1536
    blocks = q4_1_blocks(n_out, k_in, seed=11)
    tiles, packed = k.pack_tiles(dequantize_rows(blocks)), k.pack_q4_1(blocks)
    b = torch.randn(n_out).to(torch.bfloat16) if bias else None
    x, h, norm = row(k_in, seed=12), row(n_out, seed=13), row(n_out, seed=14)[0]
    y_tiles, h_tiles, out_tiles = torch.empty(1, n_out, dtype=torch.bfloat16), h.clone(), torch.empty_like(h)
    assert k.lib.kvseal_linear_tiles_add_norm_bf16(*map(k.ptr, (x, tiles, b, y_tiles, h_tiles, norm)), 1e-5,
                                                   k.ptr(out_tiles), 1, n_out, k_in, torch.get_num_threads()) == 0
    y = k.linear_q4_1_row(x, packed, b, n_out)
    if tile_engine == "amx":
        assert y is None
        return
    assert y is not None
    h_rows, out_rows = h.clone(), torch.empty_like(h)
    k.add_rms_norm(h_rows, y, norm, 1e-5, out_rows)
    assert torch.equal(y, y_tiles) and torch.equal(h_rows, h_tiles) and torch.equal(out_rows, out_tiles)


@needs_tiles
def test_row_kernels_refuse_what_they_cannot_read() -> None:
    k = kernels()
    packed = k.pack_q4_1(q4_1_blocks(32, 64, seed=2))
    with pytest.raises(TypeError):
        k.linear_q4_1_row(row(64, 0).repeat(2, 1), packed, None, 32)  # two rows
    with pytest.raises(TypeError):
        k.linear_q4_1_row(row(96, 0), packed, None, 32)  # another width
    with pytest.raises(TypeError):
        k.linear_q4_1_row(row(64, 0), packed, None, 48)  # more outputs than the panels hold
