"""Decode attention over the paged pool: the native kernel (`NativeOps`) against the torch
formulation (`TorchOps`).

Both plans are built from the same batch through `AttentionPlan.build`; the kernel must give
the same output (float32 tolerance) for every head size it specializes and one it does not,
GQA groups, contexts that end mid-page and span many pages, and scattered page tables. Neither
may read anything but the row's own written slots: every other slot of the pool is NaN here.
Over a bfloat16 pool each way of computing the scores is held to float32 attention over each
row's own slots, rounded once.
"""

from __future__ import annotations

import pytest
import torch
from built_kernels import kernels, native_ops, needs_kernels

import kvseal.models.attention as attention
from kvseal.kvcache.pool import KVPool
from kvseal.ops import DecodePlan, TorchOps
from kvseal.ops.native_plans import NativeRows
from kvseal.ops.torch_attention import GatheredRows
from kvseal.types import ForwardBatch

pytestmark = needs_kernels
BF16 = torch.bfloat16
ULP = 2.0**-7  # one bfloat16 ulp, relative (8 significant bits)


def _decode_batch(pool: KVPool, context_lens: list[int], generator: torch.Generator) -> ForwardBatch:
    """Decode rows on disjoint, scattered pages; only each row's first context_len slots are
    written (finite), every other slot of the pool stays NaN."""
    page_size = pool.page_size
    counts = [-(-n // page_size) for n in context_lens]
    order = torch.randperm(pool.num_pages, generator=generator)[: sum(counts)]
    tables = list(order.split(counts))
    for layer in range(len(pool.k)):
        pool.k[layer].fill_(float("nan")), pool.v[layer].fill_(float("nan"))
        for table, n in zip(tables, context_lens):
            slots = (table[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:n]
            shape = (n, pool.k[layer].shape[0], pool.k[layer].shape[-1])
            pool.write(layer, slots, torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
    rows = len(context_lens)
    return ForwardBatch(torch.zeros(rows, dtype=torch.long), torch.tensor(context_lens) - 1,
                        torch.zeros(rows, dtype=torch.long), [1] * rows, context_lens, tables, torch.arange(rows))


def _both_plans(batch: ForwardBatch, pool: KVPool, num_heads: int) -> tuple[DecodePlan, DecodePlan]:
    """The decode rows with the kernel, and the torch formulation's for the same batch."""
    native = attention.AttentionPlan.build(batch, pool, num_heads, native_ops()).decode
    reference = attention.AttentionPlan.build(batch, pool, num_heads, TorchOps()).decode
    assert native is not None and isinstance(native.plan, NativeRows), "a float32 pool uses the kernel"
    assert reference is not None and isinstance(reference.plan, GatheredRows)
    return native.plan, reference.plan


def _attend(q: torch.Tensor, pool: KVPool, layer: int, native: DecodePlan,
            reference: DecodePlan) -> tuple[torch.Tensor, torch.Tensor]:
    return native_ops().decode_attention(q, pool, layer, native), TorchOps().decode_attention(q, pool, layer, reference)


# groups of 3, 1, 4 (3 + 1 heads a pass), 2 and 5 (3 + 2); head_dim 48 takes the plain loops
@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads"),
                         [(64, 9, 3), (32, 4, 4), (128, 8, 2), (64, 4, 2), (64, 10, 2), (48, 6, 3)])
def test_kernel_matches_torch_formulation(head_dim: int, num_heads: int, num_kv_heads: int) -> None:
    generator = torch.Generator().manual_seed(head_dim)
    pool = KVPool(2, 64, 16, num_kv_heads, head_dim, torch.float32)
    context_lens = [2, 16, 17, 37, 100, 5, 64]
    batch = _decode_batch(pool, context_lens, generator)
    native, reference = _both_plans(batch, pool, num_heads)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=generator) * 3
    for layer in range(2):
        got, want = _attend(q, pool, layer, native, reference)
        assert torch.isfinite(got).all(), "the kernel read a slot outside its rows' written context"
        assert torch.isfinite(want).all(), "the torch formulation read a slot outside its rows' written context"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_in_a_mixed_batch_and_with_non_contiguous_q() -> None:
    """Decode rows between prefill chunks (q gathered by token index) and q as a strided view."""
    generator = torch.Generator().manual_seed(7)
    pool = KVPool(1, 32, 16, 3, 64, torch.float32)
    batch = _decode_batch(pool, [20, 45], generator)
    native, reference = _both_plans(batch, pool, 9)
    wide = torch.randn(2, 9, 128, generator=generator)
    q = wide[:, :, :64]  # not contiguous, like a slice of a packed projection
    torch.testing.assert_close(*_attend(q, pool, 0, native, reference), rtol=1e-5, atol=1e-5)


def test_extreme_scores_stay_finite() -> None:
    """Large score gaps (exp underflow) and equal scores (uniform weights) match the reference."""
    generator = torch.Generator().manual_seed(3)
    pool = KVPool(1, 16, 16, 1, 64, torch.float32)
    batch = _decode_batch(pool, [40, 40], generator)
    native, reference = _both_plans(batch, pool, 1)
    for q in (torch.randn(2, 1, 64, generator=generator) * 200, torch.zeros(2, 1, 64)):
        got, want = _attend(q, pool, 0, native, reference)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


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
@pytest.mark.parametrize("scores", ["KVSEAL_SCORES_AMX", "KVSEAL_SCORES_DOT", "KVSEAL_SCORES_WIDENED"])
@pytest.mark.parametrize("head_dim, group, page_size", [(64, 3, 16), (32, 1, 4), (128, 4, 4), (20, 2, 4), (16, 2, 4)])
def test_decode_attention_bf16_reads_only_each_rows_slots(head_dim: int, group: int, page_size: int,
                                                          scores: str) -> None:
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
    values_k, values_v = _randn_bf16(*k.shape, seed=9), _randn_bf16(*v.shape, seed=10)
    for b in range(rows):
        slots = (tables[b][:, None] * page_size + torch.arange(page_size)).reshape(-1)[:int(lens[b])]
        for pool, values in ((k, values_k), (v, values_v)):
            pool.view(kv_heads, -1, head_dim)[:, slots] = values.view(kv_heads, -1, head_dim)[:, slots]
    qkv = _randn_bf16(rows, (kv_heads * group + 2 * kv_heads) * head_dim, seed=11)
    q = qkv[:, :kv_heads * group * head_dim].view(rows, kv_heads * group, head_dim)  # rows at qkv's stride
    out = kernels().decode_attention(q, k, v, tables, lens, int(lens.max()), getattr(kernels().lib, scores))
    assert out.dtype == BF16 and bool(torch.isfinite(out).all())
    torch.testing.assert_close(out.float(), _reference_attention(q, k, v, tables, lens), rtol=ULP, atol=ULP / 8)


def _randn_bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)
