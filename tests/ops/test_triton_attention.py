"""The Triton attention kernels against a torch reference, on CPU tensors under Triton's
interpreter: varied page tables, cached prefixes, chunk boundaries, GQA ratios, page sizes and
dtypes, with NaN in every slot a row does not own or has not written (one such read would make
its output NaN)."""

from __future__ import annotations

import math

import pytest
import torch

from kvseal.ops import triton_attention

# tests/ops/conftest.py switched the interpreter on before this import
assert triton_attention.WIDEN_DOTS, "kvseal.ops.triton_attention was imported before TRITON_INTERPRET=1"

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """q [n, H, D] at `positions` over keys/values [ctx, KV, D] (each query sees keys 0..pos), float32."""
    num_heads, num_kv = q.shape[1], keys.shape[1]
    k = keys.float().repeat_interleave(num_heads // num_kv, dim=1)  # [ctx, H, D]
    v = values.float().repeat_interleave(num_heads // num_kv, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.float(), k) / math.sqrt(q.shape[-1])
    visible = torch.arange(keys.shape[0])[None, :] <= positions[:, None]  # [n, ctx]
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)


class Pool:
    """One layer's pool [KV, pages, page_size, D], NaN everywhere but the slots written."""

    def __init__(self, num_pages: int, page_size: int, num_kv: int, head_dim: int, dtype: torch.dtype) -> None:
        self.page_size = page_size
        self.k = torch.full((num_kv, num_pages, page_size, head_dim), float("nan"), dtype=dtype)
        self.v = torch.full_like(self.k, float("nan"))

    def write(self, pages: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write a sequence's keys/values [n, KV, D] into its slots 0..n-1 through `pages`."""
        for n in range(keys.shape[0]):
            page, offset = pages[n // self.page_size], n % self.page_size
            self.k[:, page, offset] = keys[n]
            self.v[:, page, offset] = values[n]


def tables_of(page_lists: list[list[int]], width: int) -> torch.Tensor:
    """Rows padded past their pages with page 0, which other rows own: padding is never read."""
    return torch.tensor([pages + [0] * (width - len(pages)) for pages in page_lists], dtype=torch.int64)


def sequences(seed: int, context_lens: list[int], page_size: int, num_kv: int, head_dim: int,
              dtype: torch.dtype) -> tuple[Pool, list[list[int]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """Random keys/values per sequence written into shuffled, disjoint pages of a NaN pool."""
    gen = torch.Generator().manual_seed(seed)
    needed = [math.ceil(n / page_size) for n in context_lens]
    order = torch.randperm(sum(needed) + 3, generator=gen).tolist()  # a few pages nobody owns
    pool = Pool(len(order), page_size, num_kv, head_dim, dtype)
    page_lists, kv = [], []
    for n, num_pages in zip(context_lens, needed):
        pages, order = order[:num_pages], order[num_pages:]
        keys = torch.randn(n, num_kv, head_dim, generator=gen).to(dtype)
        values = torch.randn(n, num_kv, head_dim, generator=gen).to(dtype)
        pool.write(pages, keys, values)
        page_lists.append(pages)
        kv.append((keys, values))
    return pool, page_lists, kv


CASES = [  # (context_lens, page_size, num_heads, num_kv, head_dim)
    ([1, 5, 16, 37], 4, 4, 4, 16),  # MHA, a one-token row, exact page ends
    ([9, 64, 3], 16, 8, 2, 32),  # GQA 4:1
    ([70, 2], 8, 6, 1, 8),  # one KV head (MQA), head_dim below the dot block
    ([33], 4, 12, 4, 64),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_decode_reads_only_its_own_written_slots(case: tuple, dtype: torch.dtype) -> None:
    context_lens, page_size, num_heads, num_kv, head_dim = case
    pool, page_lists, kv = sequences(1, context_lens, page_size, num_kv, head_dim, dtype)
    q = torch.randn(len(context_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    tables = tables_of(page_lists, max(map(len, page_lists)) + 2)
    out = triton_attention.paged_decode_attention(q, pool.k, pool.v, tables, torch.tensor(context_lens))
    assert out.dtype == dtype and not out.isnan().any()
    for b, (keys, values) in enumerate(kv):
        expected = reference(q[b : b + 1], keys, values, torch.tensor([context_lens[b] - 1]))
        torch.testing.assert_close(out[b : b + 1].float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_the_nan_pool_catches_a_read_past_what_a_row_wrote() -> None:
    """The negative control: a context one slot longer than what was written, through a page
    nobody wrote, turns that row's output NaN, and only that row's."""
    pool, page_lists, _ = sequences(3, [8, 8], 4, 2, 16, torch.float32)
    unwritten = sorted(set(range(pool.k.shape[1])) - {p for pages in page_lists for p in pages})[0]
    tables = tables_of([page_lists[0], page_lists[1] + [unwritten]], 3)
    out = triton_attention.paged_decode_attention(torch.randn(2, 2, 16), pool.k, pool.v, tables,
                                                  torch.tensor([8, 9]))
    assert not out[0].isnan().any() and out[1].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_prefill_after_a_prefix_reads_only_its_own_slots(case: tuple, dtype: torch.dtype) -> None:
    """Chunks of varied length at the end of each sequence (its prefix cached or computed
    before), several chunks in one launch, query blocks split mid-chunk."""
    context_lens, page_size, num_heads, num_kv, head_dim = case
    pool, page_lists, kv = sequences(4, context_lens, page_size, num_kv, head_dim, dtype)
    q_lens = [max(1, (n * 2) // 3) for n in context_lens]
    q_starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()[:-1]])
    total = sum(q_lens)
    q = torch.randn(total, num_heads, head_dim, generator=torch.Generator().manual_seed(5)).to(dtype)
    out = torch.full((total + 3, num_heads, head_dim), 7.0, dtype=dtype)  # rows past the chunks stay
    triton_attention.paged_prefill_attention(q, pool.k, pool.v, tables_of(page_lists, max(map(len, page_lists)) + 1),
                                             q_starts, torch.tensor(q_lens), torch.tensor(context_lens), out,
                                             max(q_lens))
    assert (out[total:] == 7.0).all() and not out[:total].isnan().any()
    for c, (keys, values) in enumerate(kv):
        rows = slice(int(q_starts[c]), int(q_starts[c]) + q_lens[c])
        positions = torch.arange(context_lens[c] - q_lens[c], context_lens[c])
        expected = reference(q[rows], keys, values, positions)
        torch.testing.assert_close(out[rows].float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv,head_dim", [(4, 4, 16), (8, 2, 32), (6, 1, 8)])
def test_fresh_prefill_reads_only_its_own_rows(num_heads: int, num_kv: int, head_dim: int, dtype: torch.dtype) -> None:
    """Chunks from position 0 over this forward's k, v only; the rows between the chunks are NaN
    (another request's tokens in the same forward)."""
    gen = torch.Generator().manual_seed(6)
    q_lens, gap = [1, 17, 40, 5], 3
    q_starts = torch.tensor([sum(q_lens[:i]) + gap * i for i in range(len(q_lens))])
    total = int(q_starts[-1]) + q_lens[-1] + gap
    q = torch.full((total, num_heads, head_dim), float("nan"), dtype=dtype)
    k = torch.full((total, num_kv, head_dim), float("nan"), dtype=dtype)
    # v: a view into wider rows (as of a fused qkv projection), k its own tensor (as after a
    # per-head k norm): the two have different strides
    v = torch.full((total, 3 * num_kv, head_dim), float("nan"), dtype=dtype)[:, num_kv : 2 * num_kv]
    for start, n in zip(q_starts.tolist(), q_lens):
        q[start : start + n] = torch.randn(n, num_heads, head_dim, generator=gen).to(dtype)
        k[start : start + n] = torch.randn(n, num_kv, head_dim, generator=gen).to(dtype)
        v[start : start + n] = torch.randn(n, num_kv, head_dim, generator=gen).to(dtype)
    out = torch.full_like(q, 7.0)
    triton_attention.fresh_prefill_attention(q, k, v, q_starts, torch.tensor(q_lens), out, max(q_lens))
    for start, n in zip(q_starts.tolist(), q_lens):
        rows = slice(start, start + n)
        expected = reference(q[rows], k[rows], v[rows], torch.arange(n))
        torch.testing.assert_close(out[rows].float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    written = torch.zeros(total, dtype=torch.bool)
    for start, n in zip(q_starts.tolist(), q_lens):
        written[start : start + n] = True
    assert (out[~written] == 7.0).all()


def test_pools_that_disagree_are_refused() -> None:
    pool = Pool(4, 4, 2, 16, torch.float32)
    with pytest.raises(ValueError, match="not a multiple"):
        triton_attention.paged_decode_attention(torch.randn(1, 3, 16), pool.k, pool.v, tables_of([[0]], 1),
                                                torch.tensor([1]))
    with pytest.raises(ValueError, match="head_dim"):
        triton_attention.paged_decode_attention(torch.randn(1, 2, 8), pool.k, pool.v, tables_of([[0]], 1),
                                                torch.tensor([1]))
