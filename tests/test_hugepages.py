"""`huge_empty` / `huge_zeros`: tensors that start on a 2 MB boundary of their own mapping,
advised onto huge pages where the kernel offers them, holding no memory until written, and
otherwise exactly the tensors `torch.empty` / `torch.zeros` would give (the KV pool and the
packed weights are made with them); `BackgroundTouch`, which commits a pool's memory while the
weights load."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from kvseal.hugepages import HUGE_PAGE, SMALL_CHUNK, huge_empty, huge_zeros, touch_tensors
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


def _mapping_start(address: int) -> int:
    """The first address of the mapping that holds `address` (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        low, high = (int(x, 16) for x in line.split(" ", 1)[0].split("-"))
        if low <= address < high:
            return low
    raise LookupError(hex(address))


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


@pytest.mark.skipif(not _SMAPS.exists(), reason="no /proc/self/smaps here")
def test_small_tensors_are_carved_side_by_side_from_an_advised_chunk() -> None:
    """Most packed weights are under one huge page: they share advised chunks instead of each
    taking ordinary heap pages (the decode step streams them all)."""
    tensors = [huge_empty((n, 64), dtype) for n, dtype in ((4, torch.float32), (3, torch.bfloat16), (700, torch.int8))]
    for t, (n, dtype) in zip(tensors, ((4, torch.float32), (3, torch.bfloat16), (700, torch.int8))):
        assert t.shape == (n, 64) and t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 4096 == 0
    first, second, third = (t.data_ptr() for t in tensors)
    assert second - first == 4096 and third - second == 4096, "consecutive, each on its own 4 KB boundary"
    for t in tensors:  # each is its own memory: writing one leaves the others as they were
        t.fill_(1)
    tensors[1].zero_()
    assert int(tensors[0].sum()) == 4 * 64 and int(tensors[2].sum()) == 700 * 64 and not tensors[1].any()
    mapping = _mapping_of(first)
    assert mapping is not None and _kib(mapping, "Size") >= SMALL_CHUNK // 1024
    if _THP.exists() and "[never]" not in _THP.read_text():
        assert "hg" in mapping["VmFlags"].split(), "the chunk is advised onto huge pages"


@pytest.mark.skipif(not _SMAPS.exists(), reason="no /proc/self/smaps here")
def test_a_small_tensor_that_does_not_fit_the_rest_of_its_chunk_starts_a_new_one() -> None:
    size = HUGE_PAGE - 4096  # the largest small tensor: a chunk holds SMALL_CHUNK // HUGE_PAGE of them
    tensors = [huge_empty((size,), torch.uint8) for _ in range(SMALL_CHUNK // HUGE_PAGE + 2)]
    starts = sorted(t.data_ptr() for t in tensors)
    assert all(b - a >= size for a, b in zip(starts, starts[1:])), "no two overlap"
    chunks = {_mapping_start(t.data_ptr()) for t in tensors}
    assert len(chunks) >= 2, "the tensors that did not fit went to a new chunk"
    for t in tensors:  # each lies wholly inside its chunk's mapping
        assert _mapping_start(t.data_ptr() + size - 1) == _mapping_start(t.data_ptr())


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


def test_a_background_touch_writes_zeros_over_every_tensor_by_the_time_wait_returns() -> None:
    tensors = [torch.full((n, 300), 7.0) for n in (1, 50, 3000)] + [huge_empty((4, HUGE_PAGE), torch.uint8)]
    tensors[-1].fill_(9)
    touch = touch_tensors(tensors)
    touch.wait()
    assert all(not t.any() for t in tensors)
    touch.wait()  # a second wait has nothing left to do


def test_a_background_touch_takes_only_contiguous_cpu_tensors() -> None:
    with pytest.raises(TypeError, match="contiguous CPU"):
        touch_tensors([torch.zeros(4, 4).t()])
    with pytest.raises(TypeError, match="contiguous CPU"):
        touch_tensors([torch.zeros(4, 4, device="meta")])


def test_a_pool_touched_later_reads_zero_and_is_the_same_pool_once_waited_for() -> None:
    pool = KVPool(num_layers=3, num_pages=600, page_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                  touch_later=True)
    pool.wait_touched()
    pool.wait_touched()
    for tensor in pool.k + pool.v:  # 2.4 MB a layer: each its own huge-page mapping
        assert tensor.shape == (2, 600, 16, 64) and tensor.data_ptr() % HUGE_PAGE == 0 and not tensor.any()
    assert pool.has_geometry(3, 600, 16, 2, 64, torch.bfloat16)
    assert not pool.has_geometry(3, 600, 16, 2, 64, torch.float32)
    assert not pool.has_geometry(2, 600, 16, 2, 64, torch.bfloat16)
