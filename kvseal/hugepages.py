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
not Linux) the tensor is the same, on ordinary pages.

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

import ctypes
import logging
import mmap
import threading
from collections.abc import Sequence

import torch

logger = logging.getLogger("kvseal")

HUGE_PAGE = 2 * 1024 * 1024


SMALL_CHUNK = 32 * HUGE_PAGE
_SMALL_ALIGN = 4096


def _advised_region(nbytes: int) -> torch.Tensor:
    """`nbytes` of a fresh private anonymous mapping, as a uint8 tensor starting on a 2 MB
    boundary and advised onto huge pages (ordinary pages where the advice is refused)."""
    # private and anonymous (not mmap's default of shared, which is shmem: no THP, and shared
    # with a forked child); nothing is resident until written
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the mapping alive
    offset = -whole.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, offset, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
    except OSError as error:  # THP compiled out or set to `never`: ordinary pages
        logger.debug("madvise(MADV_HUGEPAGE) refused (%s): ordinary pages", error)
    return whole[offset:offset + nbytes]


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


class BackgroundTouch:
    """Commits fresh tensors' memory ahead of their use: a thread writes zeros over them (what a
    fresh mapping reads anyway), one tensor at a time, while the caller goes on; `wait()` takes
    the ones left from the caller's thread too and returns when every one is written.

    On a host that backs a VM's memory lazily, the first write of each page costs far more than
    the write (this project's 2-vCPU VMs: ~5 s per GiB on one vCPU for memory the host had taken
    back, 0.2 s where it had not). A vCPU waiting on such a fault does nothing else, so the
    thread takes one core's worth of it while the other core loads the weights."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
            raise TypeError("a background touch writes contiguous CPU tensors only")
        self._left = list(reversed(tensors))
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvseal-touch", daemon=True)
        self._thread.start()

    def _next(self) -> torch.Tensor | None:
        with self._lock:
            return self._left.pop() if self._left else None

    def _touch_left(self) -> None:
        while (tensor := self._next()) is not None:  # ctypes calls run without the GIL
            ctypes.memset(tensor.data_ptr(), 0, tensor.numel() * tensor.element_size())

    def _run(self) -> None:
        try:
            self._touch_left()
        except BaseException as error:  # noqa: BLE001 - handed to wait()'s caller
            self._error = error

    def wait(self) -> None:
        """Every tensor written (zeros); re-raises what stopped the thread."""
        self._touch_left()
        self._thread.join()
        if self._error is not None:
            raise self._error
