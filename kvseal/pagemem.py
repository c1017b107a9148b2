"""Anonymous memory advised onto huge pages, and a thread that commits memory ahead of its use.

torch-free, so that the engine process can reserve and start committing its KV pool before it
imports torch (`kvseal.kvcache.reserve`); `kvseal.hugepages` makes tensors of the same mappings.

A mapping is private and anonymous (mmap's default, shared, is shmem: no transparent huge pages,
and shared with a forked child) and 2 MB longer than asked, so that its span can start on a huge
page boundary; the slack is never written, so never resident. Nothing is resident until written.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import threading
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger("kvseal")

HUGE_PAGE = 2 * 1024 * 1024


@dataclass(frozen=True)
class AdvisedMapping:
    """`nbytes` from `offset` of `region`, starting on a 2 MB boundary, advised `MADV_HUGEPAGE`."""

    region: mmap.mmap
    offset: int
    nbytes: int
    address: int  # of the span's first byte, while the region is open


def advised_mapping(nbytes: int) -> AdvisedMapping:
    """A fresh mapping for `nbytes`, advised onto huge pages (ordinary pages where the kernel
    refuses the advice: THP compiled out or `never`)."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(region)
    base = ctypes.addressof(anchor)
    del anchor  # the buffer export ends with it: the region can still be closed
    offset = -base % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            region.madvise(mmap.MADV_HUGEPAGE, offset, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
        except OSError as error:
            logger.debug("madvise(MADV_HUGEPAGE) refused (%s): ordinary pages", error)
    return AdvisedMapping(region, offset, nbytes, base + offset)


class BackgroundTouch:
    """Commits memory ahead of its use: a thread writes zeros over spans of it (what fresh
    mappings read anyway), one span at a time, while the caller goes on; `wait()` takes the
    spans left from the caller's thread too and returns when every one is written.

    On a host that backs a VM's memory lazily, the first write of each page costs far more than
    the write (this project's 2-vCPU VMs: 3-6 s per GiB of huge pages on one vCPU for memory
    the host had taken back, 0.2 s where it had not). A vCPU waiting on such a fault does
    nothing else, so the thread takes one core's worth of it while the other core loads the
    weights. The caller keeps the memory alive until `wait()` or `stop()` has returned; `keep`
    is held for that (the tensors or mappings the spans lie in)."""

    def __init__(self, spans: Sequence[tuple[int, int]], keep: object = None) -> None:
        """spans: (address, bytes), written in this order."""
        self._left = list(reversed(spans))
        self._keep = keep
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvseal-touch", daemon=True)
        self._thread.start()

    def _next(self) -> tuple[int, int] | None:
        with self._lock:
            return self._left.pop() if self._left else None

    def _touch_left(self) -> None:
        while (span := self._next()) is not None:  # ctypes calls run without the GIL
            ctypes.memset(span[0], 0, span[1])

    def _run(self) -> None:
        try:
            self._touch_left()
        except BaseException as error:  # noqa: BLE001 - handed to wait()'s caller
            self._error = error

    def wait(self) -> None:
        """Every span written (zeros); re-raises what stopped the thread."""
        self._touch_left()
        self._thread.join()
        if self._error is not None:
            raise self._error

    def stop(self) -> None:
        """No span is started after this; returns once the thread has finished the one in hand."""
        with self._lock:
            self._left.clear()
        self._thread.join()
