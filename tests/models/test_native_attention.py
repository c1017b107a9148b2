"""The native decode attention kernel (`models/native.py`) against the torch formulation.

Both paths are built from the same batch through `AttentionPlan.build`; the kernel must give
the same output (float32 tolerance) for every head size it specializes and one it does not,
GQA groups, contexts that end mid-page and span many pages, and scattered page tables. It must
read nothing but the row's own written slots: every other slot of the pool is NaN here.
"""

from __future__ import annotations

import pytest
import torch

import kvseal.models.attention as attention
from kvseal.kvcache.pool import KVPool
from kvseal.models.native import decode_attention_kernel
from kvseal.types import ForwardBatch

pytestmark = pytest.mark.skipif(decode_attention_kernel() is None, reason="no C compiler: the kernel is not built")


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


def _torch_rows(batch: ForwardBatch, pool: KVPool, num_heads: int, monkeypatch: pytest.MonkeyPatch):
    with monkeypatch.context() as patch:
        patch.setattr(attention, "decode_attention_kernel", lambda dtype: None)
        return attention.AttentionPlan.build(batch, pool, num_heads).decode


def _both_plans(batch: ForwardBatch, pool: KVPool, num_heads: int, monkeypatch: pytest.MonkeyPatch):
    """The decode rows with the kernel, and the torch formulation's for the same batch."""
    native = attention.AttentionPlan.build(batch, pool, num_heads).decode
    reference = _torch_rows(batch, pool, num_heads, monkeypatch)
    assert native is not None and native.native is not None, "a float32 pool uses the kernel"
    assert reference is not None and reference.native is None
    return native, reference


# groups of 3, 1, 4 (3 + 1 heads a pass), 2 and 5 (3 + 2); head_dim 48 takes the plain loops
@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads"),
                         [(64, 9, 3), (32, 4, 4), (128, 8, 2), (64, 4, 2), (64, 10, 2), (48, 6, 3)])
def test_kernel_matches_torch_formulation(head_dim: int, num_heads: int, num_kv_heads: int,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    generator = torch.Generator().manual_seed(head_dim)
    pool = KVPool(2, 64, 16, num_kv_heads, head_dim, torch.float32)
    context_lens = [2, 16, 17, 37, 100, 5, 64]
    batch = _decode_batch(pool, context_lens, generator)
    native, reference = _both_plans(batch, pool, num_heads, monkeypatch)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=generator) * 3
    for layer in range(2):
        got = attention._decode_attention(q, pool, layer, native)
        want = attention._decode_attention(q, pool, layer, reference)
        assert torch.isfinite(got).all(), "the kernel read a slot outside its rows' written context"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_kernel_in_a_mixed_batch_and_with_non_contiguous_q(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode rows between prefill chunks (q gathered by token index) and q as a strided view."""
    generator = torch.Generator().manual_seed(7)
    pool = KVPool(1, 32, 16, 3, 64, torch.float32)
    batch = _decode_batch(pool, [20, 45], generator)
    native, reference = _both_plans(batch, pool, 9, monkeypatch)
    wide = torch.randn(2, 9, 128, generator=generator)
    q = wide[:, :, :64]  # not contiguous, like a slice of a packed projection
    torch.testing.assert_close(attention._decode_attention(q, pool, 0, native),
                               attention._decode_attention(q, pool, 0, reference), rtol=1e-5, atol=1e-5)


def test_extreme_scores_stay_finite(monkeypatch: pytest.MonkeyPatch) -> None:
    """Large score gaps (exp underflow) and equal scores (uniform weights) match the reference."""
    generator = torch.Generator().manual_seed(3)
    pool = KVPool(1, 16, 16, 1, 64, torch.float32)
    batch = _decode_batch(pool, [40, 40], generator)
    native, reference = _both_plans(batch, pool, 1, monkeypatch)
    for q in (torch.randn(2, 1, 64, generator=generator) * 200, torch.zeros(2, 1, 64)):
        got = attention._decode_attention(q, pool, 0, native)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, attention._decode_attention(q, pool, 0, reference), rtol=1e-4, atol=1e-4)
