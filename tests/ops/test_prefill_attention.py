"""The native prefill attention kernel (`NativeOps`, `csrc/prefill_attention.c`) against causal
SDPA (`TorchOps`).

Fresh chunks (starting at position 0) go through `AttentionPlan.build` + `paged_attention`
twice: with the native ops and the fused qkv rows handed over (the kernel) and with the torch
ops (gathered q/k/v and SDPA). They must agree to float32 tolerance for chunk lengths around the kernel's 6-row and
16-key blocks, several chunks and groups per batch, GQA groups 1, 3 and 4, and head dims that
are a multiple of 16, only of 8, and neither (that one falls back). The kernel must read only
each chunk's own rows: every other row of qkv is NaN where the test can make it so.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from built_kernels import kernels, native_ops, needs_kernels

import kvseal.models.attention as attention
from kvseal.kvcache.pool import KVPool
from kvseal.ops import NewTokens, TorchOps
from kvseal.ops.native_backend import NativeOps
from kvseal.ops.native_kernels import CachedPrefix
from kvseal.types import ForwardBatch

pytestmark = needs_kernels

PAGE_SIZE = 16


def _batch(pool: KVPool, spans: list[tuple[int, int]], generator: torch.Generator) -> ForwardBatch:
    """Sequences of (query_len, context_len) on disjoint, scattered pages. Each sequence's cached
    prefix (context_len - query_len slots) is written (finite) in every layer; every other slot
    of the pool is NaN, and the new tokens' slots are left to the caller."""
    counts = [-(-context // PAGE_SIZE) for _, context in spans]
    tables = list(torch.randperm(pool.num_pages, generator=generator)[: sum(counts)].split(counts))
    slots = [(t[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).reshape(-1) for t in tables]
    kv_heads, head_dim = pool.k[0].shape[0], pool.k[0].shape[-1]
    for layer in range(len(pool.k)):
        pool.k[layer].fill_(float("nan")), pool.v[layer].fill_(float("nan"))
        for s, (query_len, context_len) in zip(slots, spans):
            cached = s[: context_len - query_len]
            shape = (cached.numel(), kv_heads, head_dim)
            pool.write(layer, cached, torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    query_lens, context_lens = [q for q, _ in spans], [c for _, c in spans]
    positions = torch.cat([torch.arange(c - q, c) for q, c in spans])
    slot_mapping = torch.cat([s[c - q: c] for s, (q, c) in zip(slots, spans)])
    num_tokens = sum(query_lens)
    return ForwardBatch(torch.zeros(num_tokens, dtype=torch.long), positions, slot_mapping, query_lens, context_lens,
                        tables, torch.arange(num_tokens))


def _fused_rows(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, generator: torch.Generator,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [num_tokens, (heads + 2 kv_heads) * head_dim] and its q, k, v views, as in
    `Attention.forward_native`."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=generator).to(dtype)
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:].view(num_tokens, num_kv_heads, head_dim)
    return qkv, q, k, v


def _forward_both(spans: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, seed: int,
                  dtype: torch.dtype = torch.float32, ops: NativeOps | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, attention.AttentionPlan, NewTokens]:
    """One layer of attention for the batch: the native ops with the qkv rows (the kernels
    where they apply) and the torch ops, pool and rows in `dtype`."""
    ops = ops or native_ops()
    generator = torch.Generator().manual_seed(seed)
    pool = KVPool(1, 64, PAGE_SIZE, num_kv_heads, head_dim, dtype)
    batch = _batch(pool, spans, generator)
    qkv, q, k, v = _fused_rows(batch.num_tokens, num_heads, num_kv_heads, head_dim, generator, dtype)
    pool.write(0, batch.slot_mapping, k, v)
    plan = attention.AttentionPlan.build(batch, pool, num_heads, ops)
    reference_plan = attention.AttentionPlan.build(batch, pool, num_heads, TorchOps())
    tokens = NewTokens(q, k, v, qkv)
    got = attention.paged_attention(tokens, pool, 0, plan, ops)
    want = attention.paged_attention(NewTokens(q, k, v, None), pool, 0, reference_plan, TorchOps())
    return got, want, plan, tokens


def _sdpa_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[L, heads, head_dim] q and [L, kv_heads, head_dim] k, v -> causal attention [L, heads, head_dim]."""
    o = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), is_causal=True,
                                       enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("head_dim", [8, 16, 64, 72])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(3, 3), (9, 3), (8, 2)])
def test_kernel_matches_sdpa(head_dim: int, num_heads: int, num_kv_heads: int) -> None:
    """Chunk lengths around the 6- or 12-row (AVX-512) / 16-key blocks; one chunk alone and three
    of a length."""
    for length in (1, 5, 12, 13, 16, 17, 100, 256):
        for num_chunks in (1, 3):
            spans = [(length, length)] * num_chunks
            got, want, _, tokens = _forward_both(spans, num_heads, num_kv_heads, head_dim, length)
            assert native_ops().fresh_kernel_dtype(tokens) == torch.float32, "float32 rows run the kernel"
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_groups_of_different_lengths() -> None:
    """Chunks of four lengths interleaved: four groups, each chunk at its own rows."""
    spans = [(n, n) for n in (5, 17, 5, 100, 17, 5, 33)]
    got, want, plan, _ = _forward_both(spans, 9, 3, 64, 11)
    assert sorted(group.length for group in plan.fresh) == [5, 17, 33, 100]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_mixed_batch_with_decodes_and_a_continuing_chunk() -> None:
    """Decode rows, a chunk after a cached prefix (PrefillSpan) and fresh chunks in one forward:
    each path fills its own rows of the output."""
    spans = [(1, 40), (20, 20), (1, 17), (24, 57), (20, 20), (7, 7), (1, 3)]
    got, want, plan, _ = _forward_both(spans, 9, 3, 64, 5)
    assert plan.decode is not None and len(plan.prefills) == 1 and len(plan.fresh) == 2
    assert torch.isfinite(got).all(), "a path read a slot outside its rows' written context"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_head_dim_not_a_multiple_of_8_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    spans = [(17, 17), (17, 17), (5, 5)]
    calls: list[int] = []
    monkeypatch.setattr(kernels(), "prefill_attention", lambda *args: calls.append(1))
    got, want, _, tokens = _forward_both(spans, 6, 3, 12, 3)
    assert not calls and native_ops().fresh_kernel_dtype(tokens) is None, "head_dim 12 runs SDPA"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["bf16", "widened", "sdpa"])
def test_a_bfloat16_forward_runs_a_kernel(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bfloat16 pool and rows: the bfloat16 kernel where the build has one (`bf16`), else the
    float32 kernel on rows widened to float32 (`widened`, also forced here); each output rounded
    once, within bfloat16 rounding of SDPA's bfloat16 result. Where SDPA is the faster (AMX;
    `sdpa`, forced here on any host) the fresh chunks have no kernel. A decode row and a
    continuing chunk in the same forward keep their own paths and rows (the reference's torch
    decode path over the NaN-poisoned pool must stay finite too)."""
    if kernel == "bf16" and not kernels().has_prefill_attention(torch.bfloat16):
        pytest.skip("no bfloat16 prefill kernel in this build (no AVX512-BF16)")
    ops = native_ops()
    monkeypatch.setattr(ops, "sdpa_leads_fresh_prefill", lambda dtype, head_dim: kernel == "sdpa")
    if kernel == "widened":
        real = kernels().has_prefill_attention
        monkeypatch.setattr(kernels(), "has_prefill_attention", lambda dtype: dtype != torch.bfloat16 and real(dtype))
    spans = [(1, 40), (20, 20), (13, 13), (24, 57), (20, 20), (100, 100)]
    got, want, plan, tokens = _forward_both(spans, 9, 3, 64, 4, torch.bfloat16, ops)
    assert torch.isfinite(want).all(), "the torch decode path let a poisoned slot past the context in"
    assert plan.fresh
    expected_dtype = {"sdpa": None, "bf16": torch.bfloat16, "widened": torch.float32}[kernel]
    assert ops.fresh_kernel_dtype(tokens) == expected_dtype
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-6, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_only_the_chunks_own_rows(dtype: torch.dtype) -> None:
    """Rows of qkv between the chunks are NaN and the output rows outside them are a sentinel:
    the chunks' output is finite and right, and no other output row is written."""
    if not kernels().has_prefill_attention(dtype):
        pytest.skip(f"no {dtype} prefill kernel in this build")
    generator = torch.Generator().manual_seed(9)
    length, heads, kv_heads, head_dim = 37, 8, 2, 16
    starts = torch.tensor([3, 3 + length + 2, 3 + 2 * length + 9])
    qkv, q, k, v = _fused_rows(int(starts[-1]) + length + 4, heads, kv_heads, head_dim, generator, dtype)
    inside = torch.zeros(qkv.shape[0], dtype=torch.bool)
    for start in starts.tolist():
        inside[start:start + length] = True
    qkv[~inside] = float("nan")
    out = torch.full((qkv.shape[0], heads, head_dim), 7.0, dtype=dtype)
    kernels().prefill_attention(qkv, starts, length, heads, kv_heads, head_dim, out)
    assert (out[~inside] == 7.0).all()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for start in starts.tolist():
        rows = slice(start, start + length)
        want = _sdpa_chunk(*(t[rows].float() for t in (q, k, v)))
        torch.testing.assert_close(out[rows].float(), want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_bfloat16_kernel_on_each_tile_engine(head_dim: int, tile_engine: str) -> None:
    """The bfloat16 kernel on AMX tiles (head dims a multiple of 64, where the tile linears run on
    AMX) and on AVX512-BF16 dot products: chunk lengths around the 16-row blocks and 32-key
    tiles, GQA, every row between the chunks NaN and every output row outside them a sentinel.
    Each chunk's rows are within bfloat16 rounding of float32 SDPA, and no other row is written.
    Then chunks after a cached prefix, whose pool is NaN outside their own slots."""
    assert kernels().has_prefill_attention(torch.bfloat16)  # the fixture skips where no tile engine runs
    generator = torch.Generator().manual_seed(head_dim)
    heads, kv_heads = 6, 2
    for length in (1, 15, 16, 17, 31, 32, 33, 70):
        starts = torch.tensor([2, 2 + length + 3, 2 + 2 * length + 9])
        qkv, q, k, v = _fused_rows(int(starts[-1]) + length + 5, heads, kv_heads, head_dim, generator,
                                   torch.bfloat16)
        inside = torch.zeros(qkv.shape[0], dtype=torch.bool)
        for start in starts.tolist():
            inside[start:start + length] = True
        qkv[~inside] = float("nan")
        out = torch.full((qkv.shape[0], heads, head_dim), 7.0, dtype=torch.bfloat16)
        kernels().prefill_attention(qkv, starts, length, heads, kv_heads, head_dim, out)
        assert (out[~inside] == 7.0).all(), f"length {length}: a row outside the chunks was written"
        for start in starts.tolist():
            rows = slice(start, start + length)
            want = _sdpa_chunk(*(t[rows].float() for t in (q, k, v)))
            torch.testing.assert_close(out[rows].float(), want, rtol=2e-2, atol=2e-2)
    got, want, plan, _ = _forward_both([(64, 700), (13, 29), (100, 100), (17, 50)], 9, 3, head_dim, 6, torch.bfloat16)
    assert len(plan.prefills) == 3
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_extreme_scores_stay_finite() -> None:
    """Large score gaps (exp underflow) and equal scores (uniform weights)."""
    generator = torch.Generator().manual_seed(4)
    for scale in (200.0, 0.0):
        qkv, q, k, v = _fused_rows(50, 4, 2, 32, generator)
        qkv[:, : 4 * 32] *= scale
        out = torch.empty(50, 4, 32)
        kernels().prefill_attention(qkv, torch.tensor([0]), 50, 4, 2, 32, out)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, _sdpa_chunk(q, k, v), rtol=1e-4, atol=1e-4)


def test_wrapper_refuses_bad_arguments() -> None:
    run = kernels().prefill_attention
    qkv = torch.zeros(10, 4 * 12)
    with pytest.raises(ValueError):
        run(qkv, torch.tensor([0]), 10, 2, 1, 12, torch.empty(10, 2, 12))
    qkv = torch.zeros(10, 4 * 16)
    with pytest.raises(IndexError):
        run(qkv, torch.tensor([4]), 7, 2, 1, 16, torch.empty(10, 2, 16))
    with pytest.raises(TypeError):
        run(qkv, torch.tensor([0], dtype=torch.int32), 7, 2, 1, 16, torch.empty(10, 2, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_after_a_cached_prefix_run_the_kernel(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks that continue a cached prefix (one kernel call each: the chunk's own rows of qkv
    and its sequence's own pool slots 0..prefix-1) against SDPA over the gathered pages. Every
    other slot of the pool is NaN (`_batch`), so a read outside the prefix would show."""
    if not kernels().has_prefill_attention(dtype):
        pytest.skip(f"no {dtype} prefill kernel in this build")
    calls: list[int] = []
    real = kernels().prefill_attention

    def counted(*args: object, **kwargs: object) -> None:
        calls.append(int(isinstance(args[-1] if args else None, CachedPrefix)))
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kernels(), "prefill_attention", counted)
    spans = [(64, 700), (1, 30), (13, 29), (100, 100), (17, 50)]
    got, want, plan, _ = _forward_both(spans, 9, 3, 64, 6, dtype)
    assert len(plan.prefills) == 3 and sum(calls) == 3, "each chunk after a prefix ran the kernel"
    assert torch.isfinite(got).all() and torch.isfinite(want).all()
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tolerance, atol=tolerance)


def test_the_prefix_kernel_refuses_what_it_cannot_read() -> None:
    run = kernels().prefill_attention
    pool = KVPool(1, 4, PAGE_SIZE, 2, 16, torch.float32)
    qkv, *_ = _fused_rows(8, 4, 2, 16, torch.Generator().manual_seed(1))
    out = torch.empty(8, 4, 16)
    one = torch.tensor([0])
    with pytest.raises(IndexError):  # a page outside the pool
        run(qkv, one, 8, 4, 2, 16, out,
                              CachedPrefix(20, torch.tensor([0, 9]), pool.k[0], pool.v[0]))
    with pytest.raises(IndexError):  # longer than its pages
        run(qkv, one, 8, 4, 2, 16, out,
                              CachedPrefix(40, torch.tensor([0, 1]), pool.k[0], pool.v[0]))
    with pytest.raises(ValueError):  # two chunks share no table
        run(qkv, torch.tensor([0, 4]), 4, 4, 2, 16, out,
                              CachedPrefix(4, torch.tensor([0]), pool.k[0], pool.v[0]))


def test_sdpa_leads_only_bfloat16_on_amx_for_head_dims_the_tile_kernel_skips() -> None:
    ops = native_ops()
    amx = kernels().tile_engine == kernels().TILES_AMX
    assert ops.sdpa_leads_fresh_prefill(torch.bfloat16, 72) == amx
    assert not ops.sdpa_leads_fresh_prefill(torch.bfloat16, 64)
    assert not ops.sdpa_leads_fresh_prefill(torch.bfloat16, 128)
    assert not ops.sdpa_leads_fresh_prefill(torch.float32, 72)
