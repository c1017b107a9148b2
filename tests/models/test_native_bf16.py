"""The bfloat16 forward with native kernels (`dtype=bfloat16`, what `dtype=auto` picks on CPUs that
multiply bfloat16 natively). Each kernel rounds where torch's bfloat16 op rounds, so it equals the
torch formulation it replaces, up to the float32 order of its sums; decode attention reads only
each row's own slots below its context length; and the engine's logits stay within bfloat16
rounding of transformers' bfloat16 forward on the same weights. Skipped without a C compiler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from kvseal import LLM, SamplingParams
from kvseal.models import native
from kvseal.models.llama import CausalLM
from kvseal.models.packed import PackedLinear, TileLinear, onednn_bf16, tile_library
from kvseal.models.rope import RotaryEmbedding

LIBRARY = native.native_library()
pytestmark = pytest.mark.skipif(LIBRARY is None, reason="no C compiler: the native library is not built")
BF16 = torch.bfloat16
ULP = 2.0**-7  # one bfloat16 ulp, relative (8 significant bits)


def _library() -> native.NativeLibrary:
    assert LIBRARY is not None
    return LIBRARY


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
    native.add_rms_norm(_library(), h, delta, weight, 1e-5, out)
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
    native.add_rms_norm(_library(), h, delta, torch.ones(dim, dtype=BF16), 1e-5, torch.empty_like(h))
    assert torch.isnan(h[1, 7]) and torch.isnan(summed[1, 7])
    h[1, 7] = summed[1, 7] = 0.0
    assert torch.equal(h, summed)
    assert h[0, 0] == 1.0 and h[0, 1] == 1 + 2.0**-6 and torch.isinf(h[0, 2])


@pytest.mark.parametrize("rows, inter", [(3, 64), (20, 36)])  # 36: a tail; 20: the rows split over threads
def test_silu_mul_rounds_as_torch(rows: int, inter: int) -> None:
    gate_up = _randn(rows, 2 * inter, seed=4, scale=3.0)
    gate, up = gate_up.chunk(2, dim=-1)
    _assert_within_ulp(native.silu_mul(_library(), gate_up), F.silu(gate) * up, 0.01)


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
    native.rope_(_library(), rotated, cos, signed_sin, heads, head_dim)
    assert torch.equal(rotated[:, :heads * head_dim].view(rows, heads, head_dim), expected)
    assert torch.equal(rotated[:, heads * head_dim:], qkv[:, heads * head_dim:])  # the other columns untouched


def test_write_slots_bf16_writes_exactly_its_slots() -> None:
    kv_heads, head_dim, num_pages, page_size = 2, 8, 5, 4
    k_pool, v_pool = (torch.zeros(kv_heads, num_pages, page_size, head_dim, dtype=BF16) for _ in range(2))
    qkv = _randn(3, 6 * head_dim, seed=7)  # q (2 heads), k (2), v (2)
    slots = torch.tensor([0, 9, 19])
    native.write_slots(_library(), qkv, 2 * head_dim, 4 * head_dim, slots, k_pool, v_pool)
    for pool, column in ((k_pool, 2), (v_pool, 4)):
        flat = pool.view(kv_heads, -1, head_dim)
        expected = torch.zeros_like(flat)
        written = qkv[:, column * head_dim:(column + 2) * head_dim].view(3, kv_heads, head_dim)
        expected[:, slots] = written.transpose(0, 1)
        assert torch.equal(flat, expected)
    before = k_pool.clone()
    with pytest.raises(IndexError):
        native.write_slots(_library(), qkv, 2 * head_dim, 4 * head_dim, torch.tensor([1, 2, 20]), k_pool, v_pool)
    assert torch.equal(k_pool, before)  # a slot outside the layer: nothing written


@pytest.mark.parametrize("rows", [1, 21, 45])
def test_gate_up_and_silu_in_one_tile_pass_equal_the_two_passes(rows: int, tile_engine: str) -> None:
    """Gate panel q pairs with up panel inter/16 + q, and the epilogue rounds as the two passes
    round (gate and up, then silu, then the product): bit-equal, with the [rows, 2 * inter]
    intermediate never written. An inter that is not a multiple of 16 is declined."""
    inter, k_in = 48, 64
    gate_up = _randn(2 * inter, k_in, seed=12, scale=0.3)
    x = _randn(rows, k_in, seed=13)
    tiles = native.pack_tiles(_library(), gate_up)
    fused = native.linear_silu(_library(), x, tiles, None, inter)
    two_passes = native.silu_mul(_library(), native.linear_tiles(_library(), x, tiles, None, 2 * inter))
    assert fused is not None and torch.equal(fused, two_passes)
    odd = native.pack_tiles(_library(), _randn(2 * 40, k_in, seed=14))
    assert native.linear_silu(_library(), x, odd, None, 40) is None


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
                         lens: torch.Tensor) -> torch.Tensor:
    """float32 attention over each row's slots 0..len-1, from the same bfloat16 values."""
    kv_heads, _, page_size, head_dim = k.shape
    group = q.shape[1] // kv_heads
    out = []
    for b in range(q.shape[0]):
        slots = (tables[b][:, None] * page_size + torch.arange(page_size)).reshape(-1)[:int(lens[b])]
        keys, values = (t.reshape(kv_heads, -1, head_dim)[:, slots].float() for t in (k, v))
        queries = q[b].float().view(kv_heads, group, head_dim)
        probs = torch.softmax(queries @ keys.transpose(1, 2) * head_dim**-0.5, dim=-1)
        out.append((probs @ values).reshape(-1, head_dim))
    return torch.stack(out)


# each way of computing the scores this CPU and build have (each falls back to the next where not)
@pytest.mark.parametrize("scores", [native.SCORES_AMX, native.SCORES_DOT, native.SCORES_WIDENED])
@pytest.mark.parametrize("head_dim, group, page_size", [(64, 3, 16), (32, 1, 4), (128, 4, 4), (20, 2, 4), (16, 2, 4)])
def test_decode_attention_bf16_reads_only_each_rows_slots(head_dim: int, group: int, page_size: int,
                                                          scores: int) -> None:
    """Every slot of the pool that no row may read holds NaN (other rows' pages, free pages,
    slots past a row's context in its own last page): the outputs are finite and equal float32
    attention over each row's own slots, rounded once. 20 and 16: head_dims the paged kernels do not take."""
    kv_heads, rows = 2, 5
    lens = torch.tensor([1, 7, 16, 33, 50])
    width = -(-int(lens.max()) // page_size)
    num_pages = rows * width + 6  # some pages no row holds
    tables = torch.randperm(num_pages, generator=torch.Generator().manual_seed(8))[:rows * width].view(rows, width)
    k = torch.full((kv_heads, num_pages, page_size, head_dim), float("nan"), dtype=BF16)
    v = k.clone()
    values_k, values_v = _randn(*k.shape, seed=9), _randn(*v.shape, seed=10)
    for b in range(rows):
        slots = (tables[b][:, None] * page_size + torch.arange(page_size)).reshape(-1)[:int(lens[b])]
        for pool, values in ((k, values_k), (v, values_v)):
            pool.view(kv_heads, -1, head_dim)[:, slots] = values.view(kv_heads, -1, head_dim)[:, slots]
    qkv = _randn(rows, (kv_heads * group + 2 * kv_heads) * head_dim, seed=11)
    q = qkv[:, :kv_heads * group * head_dim].view(rows, kv_heads * group, head_dim)  # rows at qkv's stride
    kernel = native.decode_attention_kernel(BF16)
    assert kernel is not None
    out = native.run_decode_attention(kernel, q, k, v, tables, lens, int(lens.max()), scores)
    assert out.dtype == BF16 and bool(torch.isfinite(out).all())
    torch.testing.assert_close(out.float(), _reference_attention(q, k, v, tables, lens), rtol=ULP, atol=ULP / 8)


def test_the_bf16_engine_runs_native_with_packed_linears(llama_dir: Path) -> None:
    """Tiles where this CPU and build run them (AMX or AVX512-BF16), else oneDNN's packing where
    it multiplies bfloat16, else plain linears."""
    model = LLM(str(llama_dir), kv_cache_tokens=256, page_size=4, dtype="bfloat16").engine.runner.model
    assert isinstance(model, CausalLM) and model.native is not None
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear, TileLinear))]
    kind = TileLinear if tile_library() is not None else PackedLinear if onednn_bf16() else torch.nn.Linear
    assert linears and all(isinstance(m, kind) for m in linears)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "qwen3"])  # qwen3: head_dim 32, the paged kernel
@pytest.mark.parametrize("linears", ["tiles", "fallback"])  # fallback: a CPU without AVX512-BF16 (oneDNN or nn.Linear)
def test_bf16_logits_within_rounding_of_transformers(arch: str, linears: str, tiny_model_dirs: dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The logits of a prefill and of each decode step after it, against transformers' bfloat16
    forward of the same tokens (teacher-forced: both see kvseal's tokens)."""
    from kvseal.engine.batch import build_forward_batch
    from kvseal.models import packed
    from kvseal.types import Request, ScheduledChunk

    if linears == "tiles" and tile_library() is None:
        pytest.skip("no tile linears here (CPU or build)")
    if linears == "fallback":
        monkeypatch.setattr(packed, "tile_library", lambda: None)
    engine = LLM(str(tiny_model_dirs[arch]), kv_cache_tokens=256, page_size=4, dtype="bfloat16").engine
    assert any(isinstance(m, TileLinear) for m in engine.runner.model.modules()) == (linears == "tiles")
    prompt, steps = list(range(30, 75)), 6
    request = Request("r", "t", prompt, SamplingParams(max_tokens=steps))
    engine.kv.reserve("r", "t", len(prompt) + steps)
    ours, tokens, chunk = [], list(prompt), len(prompt)
    for _ in range(steps):
        prepared = build_forward_batch([ScheduledChunk(request, chunk)], engine.kv)
        with engine.kv.recording(prepared.writes):
            logits = engine.runner.run(prepared.batch).logits[-1]
        ours.append(logits)
        tokens.append(int(logits.argmax()))
        request.num_computed_tokens += chunk
        request.output_token_ids.append(tokens[-1])
        chunk = 1
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[arch], dtype=BF16).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([tokens])).logits[0, len(prompt) - 1:-1].float()
    scale = theirs.abs().max().item()
    torch.testing.assert_close(torch.stack(ours), theirs, rtol=0, atol=4 * ULP * scale)
