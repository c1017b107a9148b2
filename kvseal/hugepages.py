"""Large, long-lived tensors on transparent huge pages.

A decode step streams the whole KV context of every row and every packed weight from memory
once: at 32 rows on SmolLM2-135M about 470 MB of float32 K/V and 540 MB of weights. On 4 KB
pages each 4 KB of that stream is one more TLB entry to walk for. Where the kernel's
transparent huge pages are in `madvise` mode (the default of many distributions, and of this
project's hosts), memory gets 2 MB pages only where the process asks for them, so the KV pool
and the packed weights ask. `huge_empty` and `huge_zeros` give a tensor that starts on a 2 MB
boundary of a fresh anonymous mapping, advised `MADV_HUGEPAGE` before anything touches it.
The mapping is 2 MB longer than the tensor, so that the tensor can start on a boundary; that
slack is never written, so it is never resident. (Carved from a `torch.empty` buffer instead,
the slack could be heap memory already resident, and would stay so: 66 MB more RSS for the
default model and a 2 GiB pool, measured.) Where the advice is refused (THP off or `never`,
not Linux) the tensor is the same, on ordinary pages. Allocations smaller than one huge page
are plain `torch.empty`.

Measured (`bench/hugepages_ab.py`: huge against ordinary pages, alternating, in one process):
decode attention over 30 layers' pools 0.87-0.94x the time in three runs; the panel linears
0.96-1.07x, within that harness's noise.
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Sequence

import torch

logger = logging.getLogger("kvseal")

HUGE_PAGE = 2 * 1024 * 1024


def huge_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous tensor, on huge pages where it spans one or more and the
    kernel grants them (see the module's doc). Its memory is returned when the tensor and every
    view of it are gone."""
    shape = tuple(int(n) for n in shape)
    nbytes = torch.empty((), dtype=dtype).element_size() * int(torch.Size(shape).numel())
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if nbytes < HUGE_PAGE or advice is None:
        return torch.empty(shape, dtype=dtype)
    # private and anonymous (not mmap's default of shared, which is shmem: no THP, and shared
    # with a forked child); nothing is resident until written
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the mapping alive
    offset = -whole.data_ptr() % HUGE_PAGE
    try:
        region.madvise(advice, offset, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError as error:  # THP compiled out or set to `never`: ordinary pages
        logger.debug("madvise(MADV_HUGEPAGE) refused (%s): ordinary pages", error)
    return whole[offset:offset + nbytes].view(dtype).view(shape)


def huge_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """`huge_empty`, zero-filled."""
    return huge_empty(shape, dtype).zero_()
