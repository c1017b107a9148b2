"""The native fused per-layer ops (`csrc/layer_ops.c`, the gate/up + SiLU pass of the panel and
tile linears, `csrc/argmax.c`) against the torch ops they replace: float32 to float32 tolerance
(or bit-equal where they are the same arithmetic), bfloat16 rounded where torch's bfloat16 op
rounds, so equal to it up to the float32 order of a sum. Skipped without a C compiler (the
torch formulation runs there, and is what the correctness tests then check)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from built_kernels import kernels, native_ops, needs_kernels
from hypothesis import given, settings
from hypothesis import strategies as st

from kvseal.kvcache.pool import KVPool
from kvseal.models.rope import RotaryEmbedding
from kvseal.ops import TorchOps

pytestmark = needs_kernels
BF16 = torch.bfloat16
ULP = 2.0**-7  # one bfloat16 ulp, relative (8 significant bits)


@pytest.mark.parametrize("rows", [1, 5, 70])  # 70: the rows split over threads
@pytest.mark.parametrize("dim", [40, 37])  # 37: a tail past the last 8 lanes
def test_add_rms_norm_matches_torch(rows: int, dim: int) -> None:
    generator = torch.Generator().manual_seed(rows * dim)
    h, delta, weight = (torch.randn(shape, generator=generator) for shape in ((rows, dim), (rows, dim), (dim,)))
    summed = h + delta
    out = torch.empty_like(h)
    kernels().add_rms_norm(h, delta, weight, 1e-5, out)
    torch.testing.assert_close(h, summed, rtol=0, atol=0)  # the residual add is in place and exact
    torch.testing.assert_close(out, F.rms_norm(summed, (dim,), weight, 1e-5))
    kernels().add_rms_norm(h, None, weight, 1e-6, out)  # no delta: the norm alone
    torch.testing.assert_close(h, summed, rtol=0, atol=0)
    torch.testing.assert_close(out, F.rms_norm(summed, (dim,), weight, 1e-6))


def test_silu_mul_matches_torch_and_stays_finite_at_extremes() -> None:
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(9, 2 * 45, generator=generator) * 20
    gate_up[0, :6] = torch.tensor([-1e4, -100.0, -88.0, 88.0, 100.0, 1e4])  # exp would overflow either way
    gate, up = gate_up.chunk(2, dim=-1)
    out = kernels().silu_mul(gate_up)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate) * up)


@pytest.mark.parametrize("head_dim", [64, 8, 20])  # 20: a half of 10, past the last 8 lanes
def test_rope_in_place_matches_rotary_embedding(head_dim: int) -> None:
    from tiny_models import CONFIGS

    from kvseal.config import ModelConfig

    hf = CONFIGS["llama"]()
    hf.head_dim = head_dim
    rope = RotaryEmbedding(ModelConfig.from_hf(hf))
    generator = torch.Generator().manual_seed(head_dim)
    rows, heads, kv = 6, 3, 2
    qkv = torch.randn(rows, (heads + 2 * kv) * head_dim, generator=generator)
    positions = torch.tensor([0, 1, 5, 17, 300, 1023])
    cos, signed_sin = rope.cos_sin(positions, torch.float32)
    expected = RotaryEmbedding.apply(qkv[:, :(heads + kv) * head_dim].reshape(rows, -1, head_dim), (cos, signed_sin))
    values = qkv[:, (heads + kv) * head_dim:].clone()
    kernels().rope_(qkv, cos.reshape(rows, -1).contiguous(), signed_sin.reshape(rows, -1).contiguous(),
                 heads + kv, head_dim)
    torch.testing.assert_close(qkv[:, :(heads + kv) * head_dim].reshape(rows, -1, head_dim), expected)
    torch.testing.assert_close(qkv[:, (heads + kv) * head_dim:], values, rtol=0, atol=0)  # V untouched


def test_write_slots_matches_pool_write_and_refuses_a_slot_outside_the_layer() -> None:
    generator = torch.Generator().manual_seed(3)
    kv_heads, head_dim, q_width = 2, 16, 3 * 16
    qkv = torch.randn(5, q_width + 2 * kv_heads * head_dim, generator=generator)
    slots = torch.tensor([3, 0, 17, 40, 63])
    reference, pool = (KVPool(1, 16, 4, kv_heads, head_dim, torch.float32) for _ in range(2))
    k = qkv[:, q_width:q_width + kv_heads * head_dim].view(5, kv_heads, head_dim)
    v = qkv[:, q_width + kv_heads * head_dim:].view(5, kv_heads, head_dim)
    reference.write(0, slots, k, v)
    native_ops().write_kv(pool, 0, slots, k, v)
    torch.testing.assert_close(pool.k[0], reference.k[0], rtol=0, atol=0)
    torch.testing.assert_close(pool.v[0], reference.v[0], rtol=0, atol=0)
    before = pool.k[0].clone(), pool.v[0].clone()
    for bad in (64, -1):  # one past the layer's last slot, and negative
        with pytest.raises(IndexError):
            kernels().write_slots(k, v, torch.tensor([1, 2, bad, 4, 5]), pool.k[0], pool.v[0])
        assert torch.equal(pool.k[0], before[0]) and torch.equal(pool.v[0], before[1]), "nothing was written"


_SPECIALS = st.sampled_from([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0, 3.5])


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 5), n=st.integers(1, 200), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       data=st.data())
def test_argmax_rows_is_torch_argmax(rows: int, n: int, dtype: torch.dtype, data: st.DataObject) -> None:
    """Ties (first index wins), NaN (the first NaN wins), infinities, -0.0 against 0.0, rows
    shorter than the 64 lanes, one or two passes of them and tails past them: the same index as torch.argmax, in
    float32 and in bfloat16 (whose ties are common: values rounded to 8 bits), where it is
    also the argmax of the rows widened to float32."""
    values = data.draw(st.lists(st.one_of(_SPECIALS, st.floats(-4, 4, width=32)), min_size=rows * n,
                                max_size=rows * n))
    x = torch.tensor(values, dtype=torch.float32).view(rows, n).to(dtype)
    got = kernels().argmax_rows(x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(got, x.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_on_a_decode_steps_logits(dtype: torch.dtype) -> None:
    x = torch.randn(32, 49152, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[5, 40000] = x[5, 123] = 99.0  # a tie: the first index
    x[9, 7] = float("nan")
    assert torch.equal(kernels().argmax_rows(x), x.float().argmax(dim=-1))
    with pytest.raises(ValueError):
        kernels().argmax_rows(torch.empty(3, 0, dtype=dtype))
    with pytest.raises(TypeError):
        kernels().argmax_rows(x.half())


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("rows", "inter", "k_in"), [(2, 1536, 576), (7, 32, 40), (97, 48, 64), (200, 1536, 576)])
def test_linear_silu_equals_the_two_passes(rows: int, inter: int, k_in: int, threads: int) -> None:
    """gate/up and SiLU in one pass: bit-equal to the panel linear then silu_mul, for row
    counts inside one 96-row block and across blocks, pair counts the runs do not divide."""
    generator = torch.Generator().manual_seed(rows + inter)
    weight, x = torch.randn(2 * inter, k_in, generator=generator), torch.randn(rows, k_in, generator=generator)
    panels = kernels().pack_panels(weight)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused = kernels().linear_silu(x, panels, None, inter)
        two_pass = kernels().silu_mul(kernels().linear_panels(x, panels, None, 2 * inter))
    finally:
        torch.set_num_threads(before)
    assert fused is not None and torch.equal(fused, two_pass)
    torch.testing.assert_close(fused, F.silu(x @ weight[:inter].T) * (x @ weight[inter:].T), rtol=1e-3, atol=1e-2)


def test_linear_silu_declines_what_it_does_not_run() -> None:
    """One row (the one-row linear sums in four chains), bfloat16 panels and an intermediate
    size that splits a panel between gate and up go to the two-pass path (None)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 40, generator=generator)
    panels = kernels().pack_panels(weight)
    assert kernels().linear_silu(torch.randn(1, 40), panels, None, 32) is None
    assert kernels().linear_silu(torch.randn(4, 40), kernels().pack_panels(weight, torch.bfloat16),
                              None, 32) is None
    odd = kernels().pack_panels(torch.randn(2 * 24, 40, generator=generator))
    assert kernels().linear_silu(torch.randn(4, 40), odd, None, 24) is None


# ---- bfloat16


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


def _assert_within_ulp(ours: torch.Tensor, theirs: torch.Tensor, max_fraction_off: float) -> None:
    """Equal but for a few elements, each at most one bfloat16 ulp off (a float32 sum rounded
    the other way)."""
    off = ours != theirs
    assert off.float().mean().item() <= max_fraction_off
    torch.testing.assert_close(ours.float(), theirs.float(), rtol=ULP, atol=1e-6)


@pytest.mark.parametrize("rows, dim", [(1, 64), (5, 37), (70, 40)])  # 37: a tail; 70: the rows split over threads
def test_add_rms_norm_rounds_as_transformers(rows: int, dim: int) -> None:
    h, delta, weight = _randn(rows, dim, seed=1), _randn(rows, dim, seed=2), _randn(dim, seed=3)
    summed = h + delta
    expected = weight * F.rms_norm(summed.float(), (dim,), None, 1e-5).to(BF16)
    out = torch.empty_like(h)
    kernels().add_rms_norm(h, delta, weight, 1e-5, out)
    assert torch.equal(h, summed)  # the residual add is in place, rounded as torch rounds it
    _assert_within_ulp(out, expected, 0.01)


def test_residual_add_rounds_ties_and_extremes_as_torch() -> None:
    """The 16-lane narrowing (one vcvtneps2bf16 where the CPU has AVX512-BF16) on the cases a
    rounding gets wrong first: sums exactly halfway between two bfloat16 values (to even, both
    ways), overflow to infinity, infinities, and a NaN that must stay a NaN."""
    dim = 64
    h = torch.ones(2, dim)
    delta = torch.full((2, dim), 2.0**-8)  # 1 + 2^-8: halfway, rounds down to even 1.0
    delta[:, 1::4] = 3 * 2.0**-8  # halfway between 1 + 2^-7 (odd) and 1 + 2^-6: up
    h[:, 2::4], delta[:, 2::4] = 3e38, 3e38  # overflows to inf
    h[:, 3::8], delta[:, 3::8] = float("-inf"), 1.0
    h[1, 7], delta[1, 7] = float("nan"), 1.0
    h, delta = h.to(BF16), delta.to(BF16)
    summed = h + delta
    kernels().add_rms_norm(h, delta, torch.ones(dim, dtype=BF16), 1e-5, torch.empty_like(h))
    assert torch.isnan(h[1, 7]) and torch.isnan(summed[1, 7])
    h[1, 7] = summed[1, 7] = 0.0
    assert torch.equal(h, summed)
    assert h[0, 0] == 1.0 and h[0, 1] == 1 + 2.0**-6 and torch.isinf(h[0, 2])


# 45: under 256 rows (the two calls); 300: the rows split over the threads, a partial last chunk;
# 2,048 x 40 outputs: three panels, the last partial
@pytest.mark.parametrize("rows, n_out, k_in", [(45, 64, 96), (300, 64, 96), (2048, 40, 64)])
def test_tile_linear_with_add_and_norm_equals_the_two_calls(rows: int, n_out: int, k_in: int,
                                                             tile_engine: str) -> None:
    """o_proj or down_proj, then the residual add and RMSNorm, in one call
    (kvseal_linear_tiles_add_norm_bf16, the prefill loop's): the linear's outputs, the residual
    stream and the normed rows bit-equal to kvseal_linear_tiles then kvseal_add_rms_norm_bf16."""
    k = kernels()
    x, weight, bias = _randn(rows, k_in, seed=4), _randn(n_out, k_in, seed=5, scale=0.2), _randn(n_out, seed=6)
    h, norm = _randn(rows, n_out, seed=7), _randn(n_out, seed=8)
    tiles = k.pack_tiles(weight)
    y = k.linear_tiles(x, tiles, bias, n_out)
    h_two, out_two = h.clone(), torch.empty_like(h)
    k.add_rms_norm(h_two, y, norm, 1e-5, out_two)
    y_one, h_one, out_one = torch.empty_like(y), h.clone(), torch.empty_like(h)
    status = k.lib.kvseal_linear_tiles_add_norm_bf16(*map(k.ptr, (x, tiles, bias, y_one, h_one, norm)), 1e-5,
                                                     k.ptr(out_one), rows, n_out, k_in, torch.get_num_threads())
    assert status == 0
    assert torch.equal(y_one, y) and torch.equal(h_one, h_two) and torch.equal(out_one, out_two)


@pytest.mark.parametrize("rows, inter", [(3, 64), (20, 36)])  # 36: a tail; 20: the rows split over threads
def test_silu_mul_rounds_as_torch(rows: int, inter: int) -> None:
    gate_up = _randn(rows, 2 * inter, seed=4, scale=3.0)
    gate, up = gate_up.chunk(2, dim=-1)
    _assert_within_ulp(kernels().silu_mul(gate_up), F.silu(gate) * up, 0.01)


@pytest.mark.parametrize("heads, head_dim", [(5, 64), (2, 20)])  # 20: half a head is a tail
def test_rope_equals_torch_bf16_op_by_op(heads: int, head_dim: int) -> None:
    rows, extra = 7, 10
    qkv = _randn(rows, heads * head_dim + extra, seed=5)
    positions = torch.randint(0, 300, (rows,), generator=torch.Generator().manual_seed(6))
    freqs = positions.float()[:, None] / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)[None]
    cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1).to(BF16)
    signed_sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1).to(BF16)
    expected = RotaryEmbedding.apply(qkv[:, :heads * head_dim].view(rows, heads, head_dim),
                                     (cos[:, None], signed_sin[:, None]))
    rotated = qkv.clone()
    kernels().rope_(rotated, cos, signed_sin, heads, head_dim)
    assert torch.equal(rotated[:, :heads * head_dim].view(rows, heads, head_dim), expected)
    assert torch.equal(rotated[:, heads * head_dim:], qkv[:, heads * head_dim:])  # the other columns untouched


def test_write_slots_bf16_writes_exactly_its_slots() -> None:
    kv_heads, head_dim, num_pages, page_size = 2, 8, 5, 4
    k_pool, v_pool = (torch.zeros(kv_heads, num_pages, page_size, head_dim, dtype=BF16) for _ in range(2))
    qkv = _randn(3, 6 * head_dim, seed=7)  # q (2 heads), k (2), v (2)
    k, v = (qkv[:, c * head_dim:(c + 2) * head_dim].view(3, kv_heads, head_dim) for c in (2, 4))
    slots = torch.tensor([0, 9, 19])
    kernels().write_slots(k, v, slots, k_pool, v_pool)
    for pool, column in ((k_pool, 2), (v_pool, 4)):
        flat = pool.view(kv_heads, -1, head_dim)
        expected = torch.zeros_like(flat)
        written = qkv[:, column * head_dim:(column + 2) * head_dim].view(3, kv_heads, head_dim)
        expected[:, slots] = written.transpose(0, 1)
        assert torch.equal(flat, expected)
    before = k_pool.clone()
    with pytest.raises(IndexError):
        kernels().write_slots(k, v, torch.tensor([1, 2, 20]), k_pool, v_pool)
    assert torch.equal(k_pool, before)  # a slot outside the layer: nothing written


@pytest.mark.parametrize("rows", [1, 21, 45])
def test_gate_up_and_silu_in_one_tile_pass_equal_the_two_passes(rows: int, tile_engine: str) -> None:
    """Gate panel q pairs with up panel inter/16 + q, and the epilogue rounds as the two passes
    round (gate and up, then silu, then the product): bit-equal, with the [rows, 2 * inter]
    intermediate never written. An inter that is not a multiple of 16 is declined."""
    inter, k_in = 48, 64
    gate_up = _randn(2 * inter, k_in, seed=12, scale=0.3)
    x = _randn(rows, k_in, seed=13)
    tiles = kernels().pack_tiles(gate_up)
    fused = kernels().linear_silu(x, tiles, None, inter)
    two_passes = kernels().silu_mul(kernels().linear_tiles(x, tiles, None, 2 * inter))
    assert fused is not None and torch.equal(fused, two_passes)
    odd = kernels().pack_tiles(_randn(2 * 40, k_in, seed=14))
    assert kernels().linear_silu(x, odd, None, 40) is None


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_the_ops_fall_back_to_torch_for_rows_the_kernels_do_not_take(dtype: torch.dtype) -> None:
    """float16 rows, and K/V rows of different strides (per-head q/k norms make k a new tensor):
    the native ops give what the torch ops give."""
    generator = torch.Generator().manual_seed(21)
    h = torch.randn(4, 48, generator=generator).half()
    weight = torch.randn(48, generator=generator).half()
    for ops in (native_ops(), TorchOps()):
        torch.testing.assert_close(ops.add_rms_norm(h.clone(), h, weight, 1e-5, torch.empty_like(h)),
                                   TorchOps().add_rms_norm(h.clone(), h, weight, 1e-5, torch.empty_like(h)))
    qkv = torch.randn(3, 6 * 16, generator=generator).to(dtype)
    k = qkv[:, 32:64].reshape(3, 2, 16).clone()  # its own tensor
    v = qkv[:, 64:].view(3, 2, 16)
    pools = [KVPool(1, 4, 4, 2, 16, dtype) for _ in range(2)]
    native_ops().write_kv(pools[0], 0, torch.tensor([1, 6, 11]), k, v)
    TorchOps().write_kv(pools[1], 0, torch.tensor([1, 6, 11]), k, v)
    assert torch.equal(pools[0].k[0], pools[1].k[0]) and torch.equal(pools[0].v[0], pools[1].v[0])
