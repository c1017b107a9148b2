"""`huge_empty` / `huge_zeros`: tensors that start on a 2 MB boundary, advised onto huge pages
where the kernel offers them, and otherwise exactly the tensors `torch.empty` / `torch.zeros`
would give (the KV pool and the packed weights are made with them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvseal.hugepages import HUGE_PAGE, advise_huge, huge_empty, huge_zeros
from kvseal.kvcache.pool import KVPool

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_offered() -> bool:
    return _THP.exists() and "[never]" not in _THP.read_text()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_large_tensor_starts_on_a_huge_page_and_is_an_ordinary_contiguous_tensor(dtype: torch.dtype) -> None:
    shape = (3, 700, 16, 64)  # 2.15 M elements: at least one huge page in every dtype here
    t = huge_zeros(shape, dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE == 0
    assert not t.any()
    t[1, 2, 3] = 1  # writable, and views of it behave as a plain tensor's
    assert int(t.view(3, -1, 64)[1, 2 * 16 + 3].sum()) == 64
    assert int(t.count_nonzero()) == 64


def test_a_small_tensor_is_plain() -> None:
    t = huge_empty((4, 8), torch.float32)
    assert t.shape == (4, 8) and t.is_contiguous() and t.untyped_storage().nbytes() == 4 * 8 * 4


def test_advice_covers_only_whole_huge_pages() -> None:
    assert advise_huge(1, HUGE_PAGE) is False  # no whole huge page between 1 and 2 MB + 1


@pytest.mark.skipif(not _thp_offered(), reason="this kernel offers no transparent huge pages")
def test_the_kernel_takes_the_advice_where_it_offers_huge_pages() -> None:
    buffer = torch.empty(3 * HUGE_PAGE, dtype=torch.uint8)
    assert advise_huge(buffer.data_ptr(), buffer.numel())


def test_the_pool_is_made_of_huge_page_tensors() -> None:
    pool = KVPool(num_layers=2, num_pages=1024, page_size=16, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    for tensor in pool.k + pool.v:  # 4 MB per layer: each one starts on a huge page
        assert tensor.data_ptr() % HUGE_PAGE == 0 and tensor.is_contiguous() and not tensor.any()
