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
not Linux) the tensor is the same, on ordinary pages. The mappings themselves, and the thread
that commits memory ahead of use, are torch-free (`kvseal.pagemem`): the engine process reserves
its KV pool with them before it imports torch, and the pool becomes tensors over the same
mappings.

Most packed weights are smaller than a huge page (every linear of SmolLM2-135M is 0.2-1.8 MB:
together 212 of the 270 MB a decode step reads), so allocations under one huge page are carved,
4 KB-aligned, one after another from shared advised chunks of `SMALL_CHUNK` bytes: a model's
small weights sit side by side on huge pages. A chunk's memory is returned when every tensor
carved from it is gone; its untouched tail is never resident.

Measured (`bench/hugepages_ab.py`: huge against ordinary pages, alternating, in one process):
decode attention over 30 layers' pools 0.87-0.94x the time in three runs; the panel linears
0.96-1.07x, within that harness's noise. The small weights' chunks, engine against engine
(`bench/engine_ab.py --kinds decode`, bfloat16 default model): decode steps at 1 / 8 / 32
rows 0.96x / 0.95-0.96x / 1.00x; a 272 MB read on two cores, 30-33 GB/s on 4 KB pages, 35.5-36
on 2 MB pages.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Sequence

import torch

from kvseal.pagemem import HUGE_PAGE, AdvisedMapping, BackgroundTouch, advised_mapping

SMALL_CHUNK = 32 * HUGE_PAGE
_SMALL_ALIGN = 4096


def _advised_region(nbytes: int) -> torch.Tensor:
    """`nbytes` of a fresh private anonymous mapping, as a uint8 tensor starting on a 2 MB
    boundary and advised onto huge pages (`kvseal.pagemem.advised_mapping`)."""
    return mapping_tensor(advised_mapping(nbytes), torch.uint8)


def mapping_tensor(mapping: AdvisedMapping, dtype: torch.dtype, shape: Sequence[int] | None = None) -> torch.Tensor:
    """The span of `mapping` as a `dtype` tensor (of `shape`, or flat); the tensor keeps the
    mapping alive."""
    whole = torch.frombuffer(mapping.region, dtype=torch.uint8)
    flat = whole[mapping.offset:mapping.offset + mapping.nbytes].view(dtype)
    return flat if shape is None else flat.view(tuple(shape))


class _SmallArena:
    """Hands out allocations under one huge page from shared advised chunks, in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: torch.Tensor | None = None
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            start = -(-self._used // _SMALL_ALIGN) * _SMALL_ALIGN
            if self._chunk is None or start + nbytes > self._chunk.numel():
                self._chunk, start = _advised_region(SMALL_CHUNK), 0
            self._used = start + nbytes
            return self._chunk[start:start + nbytes]


_small = _SmallArena()


def huge_empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous tensor on huge pages where the kernel grants them (see the
    module's doc): its own mapping from one huge page up, else carved from a shared chunk.
    Its memory is returned when the tensor and every view of it (and, for a small one, every
    other tensor carved from its chunk) are gone."""
    shape = tuple(int(n) for n in shape)
    nbytes = torch.empty((), dtype=dtype).element_size() * int(torch.Size(shape).numel())
    if not hasattr(mmap, "MADV_HUGEPAGE"):  # not Linux
        return torch.empty(shape, dtype=dtype)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    memory = _advised_region(nbytes) if nbytes >= HUGE_PAGE else _small.take(nbytes)
    return memory.view(dtype).view(shape)


def huge_zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """`huge_empty`, zero-filled."""
    return huge_empty(shape, dtype).zero_()


def touch_tensors(tensors: Sequence[torch.Tensor]) -> BackgroundTouch:
    """`BackgroundTouch` over contiguous CPU tensors (held until it is done with them)."""
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise TypeError("a background touch writes contiguous CPU tensors only")
    return BackgroundTouch([(t.data_ptr(), t.numel() * t.element_size()) for t in tensors], keep=tuple(tensors))
