"""`huge_empty` / `huge_zeros`: tensors that start on a 2 MB boundary of their own mapping,
advised onto huge pages where the kernel offers them, holding no memory until written, and
otherwise exactly the tensors `torch.empty` / `torch.zeros` would give (the KV pool and the
packed weights are made with them)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from kvseal.hugepages import HUGE_PAGE, huge_empty, huge_zeros
from kvseal.kvcache.pool import KVPool

_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_SMAPS = Path("/proc/self/smaps")


def _mapping_of(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps fields of the mapping that holds `address` (None if none does)."""
    fields: dict[str, str] | None = None
    for line in _SMAPS.read_text().splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):  # a mapping's first line: low-high perms ...
            if fields is not None:
                return fields
            low, high = (int(x, 16) for x in head.split("-"))
            fields = {} if low <= address < high else None
        elif fields is not None:
            fields[head.rstrip(":")] = rest.strip()
    return fields


def _kib(fields: dict[str, str], name: str) -> int:
    return int(fields[name].split()[0])


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


@pytest.mark.skipif(not _SMAPS.exists(), reason="no /proc/self/smaps here")
def test_only_what_is_written_is_resident_and_the_mapping_is_advised_onto_huge_pages() -> None:
    t = huge_empty((2 * HUGE_PAGE // 4,), torch.float32)  # 4 MB, not written yet
    mapping = _mapping_of(t.data_ptr())
    assert mapping is not None and _kib(mapping, "Rss") < 64, "an unwritten tensor holds no memory"
    t.zero_()
    mapping = _mapping_of(t.data_ptr())
    assert mapping is not None
    assert 4 * 1024 <= _kib(mapping, "Rss") <= 4 * 1024 + 8, "the 2 MB of slack is never made resident"
    assert _kib(mapping, "Anonymous") == _kib(mapping, "Rss"), "private anonymous memory, not shared"
    if _THP.exists() and "[never]" not in _THP.read_text():
        assert "hg" in mapping["VmFlags"].split(), "the kernel took the MADV_HUGEPAGE advice"
    address = t.data_ptr()
    del t, mapping
    gc.collect()
    assert _mapping_of(address) is None, "the mapping goes with the tensor"


def test_the_pool_is_made_of_huge_page_tensors() -> None:
    pool = KVPool(num_layers=2, num_pages=1024, page_size=16, num_kv_heads=2, head_dim=32, dtype=torch.float32)
    for tensor in pool.k + pool.v:  # 4 MB per layer: each one starts on a huge page
        assert tensor.data_ptr() % HUGE_PAGE == 0 and tensor.is_contiguous() and not tensor.any()
