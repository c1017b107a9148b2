"""The native fused ops of the float32 forward (`models/native.py`, `csrc.OPS`) against the torch
ops they replace, and the engine's forward with them against the torch forward of the same
weights. Skipped without a C compiler (the torch formulation runs there, and is what the
correctness tests then check)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvseal.kvcache.pool import KVPool
from kvseal.models import native
from kvseal.models.rope import RotaryEmbedding
from kvseal.types import SamplingParams

LIBRARY = native.native_library()
pytestmark = pytest.mark.skipif(LIBRARY is None, reason="no C compiler: the native library is not built")


def _library() -> native.NativeLibrary:
    assert LIBRARY is not None
    return LIBRARY


@pytest.mark.parametrize("rows", [1, 5, 70])  # 70: the rows split over threads
@pytest.mark.parametrize("dim", [40, 37])  # 37: a tail past the last 8 lanes
def test_add_rms_norm_matches_torch(rows: int, dim: int) -> None:
    generator = torch.Generator().manual_seed(rows * dim)
    h, delta, weight = (torch.randn(shape, generator=generator) for shape in ((rows, dim), (rows, dim), (dim,)))
    summed = h + delta
    out = torch.empty_like(h)
    native.add_rms_norm(_library(), h, delta, weight, 1e-5, out)
    torch.testing.assert_close(h, summed, rtol=0, atol=0)  # the residual add is in place and exact
    torch.testing.assert_close(out, F.rms_norm(summed, (dim,), weight, 1e-5))
    native.add_rms_norm(_library(), h, None, weight, 1e-6, out)  # no delta: the norm alone
    torch.testing.assert_close(h, summed, rtol=0, atol=0)
    torch.testing.assert_close(out, F.rms_norm(summed, (dim,), weight, 1e-6))


def test_silu_mul_matches_torch_and_stays_finite_at_extremes() -> None:
    generator = torch.Generator().manual_seed(0)
    gate_up = torch.randn(9, 2 * 45, generator=generator) * 20
    gate_up[0, :6] = torch.tensor([-1e4, -100.0, -88.0, 88.0, 100.0, 1e4])  # exp would overflow either way
    gate, up = gate_up.chunk(2, dim=-1)
    out = native.silu_mul(_library(), gate_up)
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
    native.rope_(_library(), qkv, cos.reshape(rows, -1).contiguous(), signed_sin.reshape(rows, -1).contiguous(),
                 heads + kv, head_dim)
    torch.testing.assert_close(qkv[:, :(heads + kv) * head_dim].reshape(rows, -1, head_dim), expected)
    torch.testing.assert_close(qkv[:, (heads + kv) * head_dim:], values, rtol=0, atol=0)  # V untouched


def test_write_slots_matches_pool_write_and_refuses_a_slot_outside_the_layer() -> None:
    generator = torch.Generator().manual_seed(3)
    kv_heads, head_dim, q_width = 2, 16, 3 * 16
    qkv = torch.randn(5, q_width + 2 * kv_heads * head_dim, generator=generator)
    slots = torch.tensor([3, 0, 17, 40, 63])
    reference, pool = (KVPool(1, 16, 4, kv_heads, head_dim, torch.float32) for _ in range(2))
    k = qkv[:, q_width:q_width + kv_heads * head_dim].reshape(5, kv_heads, head_dim)
    v = qkv[:, q_width + kv_heads * head_dim:].reshape(5, kv_heads, head_dim)
    reference.write(0, slots, k, v)
    pool.write_by(0, slots, lambda k_pool, v_pool: native.write_slots(
        _library(), qkv, q_width, q_width + kv_heads * head_dim, slots, k_pool, v_pool))
    torch.testing.assert_close(pool.k[0], reference.k[0], rtol=0, atol=0)
    torch.testing.assert_close(pool.v[0], reference.v[0], rtol=0, atol=0)
    before = pool.k[0].clone(), pool.v[0].clone()
    for bad in (64, -1):  # one past the layer's last slot, and negative
        with pytest.raises(IndexError):
            native.write_slots(_library(), qkv, q_width, q_width + kv_heads * head_dim,
                               torch.tensor([1, 2, bad, 4, 5]), pool.k[0], pool.v[0])
        assert torch.equal(pool.k[0], before[0]) and torch.equal(pool.v[0], before[1]), "nothing was written"


def test_native_forward_equals_the_torch_forward(make_llm: Callable[..., Any]) -> None:
    """Greedy tokens and logprobs with the native fused ops against the same engine with torch ops
    (mixed prefill and decode steps: chunks of 32 tokens)."""
    prompts = [list(range(20, 32)), list(range(50, 90)), [7, 8]]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=0)
    llm = make_llm()
    assert llm.engine.runner.model.native is not None, "a float32 engine runs the native forward"
    fused = llm.generate(prompts, params)
    plain_llm = make_llm()
    plain_llm.engine.runner.model.use_native(None)
    plain = plain_llm.generate(prompts, params)
    for a, b in zip(fused, plain):
        assert a.token_ids == b.token_ids
        assert a.logprobs is not None and b.logprobs is not None
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in a.logprobs]),
                                   torch.tensor([lp.logprob for lp in b.logprobs]), rtol=0, atol=1e-4)


_SPECIALS = st.sampled_from([float("nan"), float("inf"), float("-inf"), 0.0, -0.0, 1.0, -1.0, 3.5])


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 5), n=st.integers(1, 70), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       data=st.data())
def test_argmax_rows_is_torch_argmax(rows: int, n: int, dtype: torch.dtype, data: st.DataObject) -> None:
    """Ties (first index wins), NaN (the first NaN wins), infinities, -0.0 against 0.0, rows
    shorter than the eight lanes and tails past them: the same index as torch.argmax, in
    float32 and in bfloat16 (whose ties are common: values rounded to 8 bits), where it is
    also the argmax of the rows widened to float32."""
    values = data.draw(st.lists(st.one_of(_SPECIALS, st.floats(-4, 4, width=32)), min_size=rows * n,
                                max_size=rows * n))
    x = torch.tensor(values, dtype=torch.float32).view(rows, n).to(dtype)
    got = native.argmax_rows(_library(), x)
    assert torch.equal(got, x.argmax(dim=-1))
    assert torch.equal(got, x.float().argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_on_a_decode_steps_logits(dtype: torch.dtype) -> None:
    x = torch.randn(32, 49152, generator=torch.Generator().manual_seed(3)).to(dtype)
    x[5, 40000] = x[5, 123] = 99.0  # a tie: the first index
    x[9, 7] = float("nan")
    assert torch.equal(native.argmax_rows(_library(), x), x.float().argmax(dim=-1))
    with pytest.raises(ValueError):
        native.argmax_rows(_library(), torch.empty(3, 0, dtype=dtype))
    with pytest.raises(TypeError):
        native.argmax_rows(_library(), x.half())


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("rows", "inter", "k_in"), [(2, 1536, 576), (7, 32, 40), (97, 48, 64), (200, 1536, 576)])
def test_linear_silu_equals_the_two_passes(rows: int, inter: int, k_in: int, threads: int) -> None:
    """gate/up and SiLU in one pass: bit-equal to the panel linear then silu_mul, for row
    counts inside one 96-row block and across blocks, pair counts the runs do not divide."""
    generator = torch.Generator().manual_seed(rows + inter)
    weight, x = torch.randn(2 * inter, k_in, generator=generator), torch.randn(rows, k_in, generator=generator)
    panels = native.pack_panels(_library(), weight)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fused = native.linear_silu(_library(), x, panels, None, inter)
        two_pass = native.silu_mul(_library(), native.linear_panels(_library(), x, panels, None, 2 * inter))
    finally:
        torch.set_num_threads(before)
    assert fused is not None and torch.equal(fused, two_pass)
    torch.testing.assert_close(fused, F.silu(x @ weight[:inter].T) * (x @ weight[inter:].T), rtol=1e-3, atol=1e-2)


def test_linear_silu_declines_what_it_does_not_run() -> None:
    """One row (the one-row linear sums in four chains), bfloat16 panels and an intermediate
    size that splits a panel between gate and up go to the two-pass path (None)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 40, generator=generator)
    panels = native.pack_panels(_library(), weight)
    assert native.linear_silu(_library(), torch.randn(1, 40), panels, None, 32) is None
    assert native.linear_silu(_library(), torch.randn(4, 40), native.pack_panels(_library(), weight, torch.bfloat16),
                              None, 32) is None
    odd = native.pack_panels(_library(), torch.randn(2 * 24, 40, generator=generator))
    assert native.linear_silu(_library(), torch.randn(4, 40), odd, None, 24) is None


def test_prefill_runs_the_mlp_in_one_pass_and_the_tokens_do_not_change(make_llm: Callable[..., Any],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from kvseal.models import llama

    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    prompts = [list(range(10, 40)), list(range(50, 61))]
    fused_calls: list[int] = []
    one_pass = llama.linear_silu

    def counted(*args: Any) -> torch.Tensor | None:
        out = one_pass(*args)
        fused_calls.append(0 if out is None else out.shape[0])
        return out

    monkeypatch.setattr(llama, "linear_silu", counted)
    fused = make_llm().generate(prompts, params)
    assert max(fused_calls) > 1, "a prefill step's MLP ran in the one-pass kernel"
    monkeypatch.setattr(llama, "linear_silu", lambda *args: None)  # the two passes everywhere
    two_pass = make_llm().generate(prompts, params)
    for a, b in zip(fused, two_pass):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs  # bit-equal, so equal logprobs
