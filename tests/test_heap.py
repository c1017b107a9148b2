"""`freeze_startup_heap`: what exists at start-up leaves the collector's reach, and the
collector still reclaims cycles made afterwards; `return_free_heap`: freed heap memory goes
back to the kernel."""

from __future__ import annotations

import ctypes
import gc
import platform
import weakref
from pathlib import Path

import pytest

from kvseal.heap import freeze_startup_heap, return_free_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_freeze_moves_the_heap_out_of_collection_and_later_cycles_are_still_reclaimed() -> None:
    before = _Node()
    before.other = before  # a cycle alive at "start-up"
    try:
        freeze_startup_heap("test")
        assert gc.get_freeze_count() > 0
        assert all(o is not before for o in gc.get_objects())  # frozen objects are not walked
        later = _Node()
        later.other = later
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None, "a cycle made after the freeze is reclaimed"
    finally:
        gc.unfreeze()
    assert any(o is before for o in gc.get_objects())


def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise LookupError("VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").exists() or platform.libc_ver()[0] != "glibc",
                    reason="glibc on Linux only")
def test_freed_heap_below_a_live_block_goes_back_to_the_kernel() -> None:
    """The loader's case: many blocks freed below one still in use, which the allocator keeps
    resident on its own (it only gives back free memory at the top of the heap)."""
    libc = ctypes.CDLL(None)
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    block = 64 * 1024  # under the allocator's mmap threshold: on the heap
    blocks = [libc.malloc(block) for _ in range(1024)]  # 64 MiB
    fence = libc.malloc(block)
    try:
        for address in blocks:
            ctypes.memset(address, 1, block)
        for address in blocks:
            libc.free(address)
        held = _rss_kib()
        assert return_free_heap()
        assert held - _rss_kib() >= 32 * 1024, "most of the 64 MiB freed below the fence is returned"
    finally:
        libc.free(fence)
