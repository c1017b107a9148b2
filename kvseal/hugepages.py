"""Large, long-lived tensors on transparent huge pages.

A decode step streams the whole KV context of every row and every packed weight from memory
once: at 32 rows on SmolLM2-135M about 470 MB of float32 K/V and 540 MB of weights. On 4 KB
pages each 4 KB of that stream is a new TLB entry to walk for. Where the kernel's transparent
huge pages are in `madvise` mode (the default of many distributions, and of this project's
hosts), memory is backed by 2 MB pages only where the process asks for it, so the KV pool
and the packed weights ask: `huge_zeros` and `huge_empty` give a tensor whose memory starts
on a 2 MB boundary, advised `MADV_HUGEPAGE` before anything touches it. Measured with decode
attention over 30 layers' pools (`bench/attention_ab.py`'s shapes, alternating): 0.95x the
time on huge pages. Where the advice is refused (no THP, `never`, not Linux) the tensor is
the same, on ordinary pages.

Only allocations of at least one huge page ask; smaller ones are plain `torch.empty`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from collections.abc import Callable, Sequence
from functools import cache

import torch

logger = logging.getLogger("kvseal")

HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


@cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        function = ctypes.CDLL(name, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


def advise_huge(address: int, length: int) -> bool:
    """Ask for huge pages over the whole 2 MB pages inside [address, address + length);
    True if the kernel took the advice (False where it refused or there is no such call)."""
    start = -(-address // HUGE_PAGE) * HUGE_PAGE
    end = (address + length) // HUGE_PAGE * HUGE_PAGE
    madvise = _madvise()
    if madvise is None or end <= start:
        return False
    if madvise(start, end - start, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) refused (errno %d): ordinary pages", ctypes.get_errno())
        return False
    return True


def huge_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous tensor, on huge pages where it spans one or more (see the
    module's doc); touch it only after this returns."""
    shape = tuple(int(n) for n in shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = itemsize * int(torch.Size(shape).numel())
    if nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    buffer = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # room to start on a 2 MB boundary
    offset = -buffer.data_ptr() % HUGE_PAGE
    advise_huge(buffer.data_ptr() + offset, nbytes)
    return buffer[offset:offset + nbytes].view(dtype).view(shape)


def huge_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """`huge_empty`, zero-filled."""
    return huge_empty(shape, dtype).zero_()
