"""The always-on isolation check and the write records' growth as native calls
(`csrc/records.c`): `kvcache.records.RecordKernels` for `WriteRecords`.

Each call hands the C the records' tensors as they are (a record row added since the last call
replaces `prefix` and `row_namespace`), checked once per new tensor: int64, contiguous, the
shapes the records promise. The batch's tensors are checked at every call.
"""

from __future__ import annotations

from typing import Any

import torch

from kvseal.kvcache.records import (
    CACHED_ROW,
    FREE_ROW,
    REFUSE_FOREIGN,
    REFUSE_NO_PAGES,
    REFUSE_UNCOVERED,
    ForwardWrites,
    WriteRecords,
)
from kvseal.ops.native_kernels import NativeKernels


class NativeRecordKernels:
    def __init__(self, kernels: NativeKernels) -> None:
        lib = kernels.lib
        assert (lib.KVSEAL_FREE_ROW, lib.KVSEAL_CACHED_ROW) == (FREE_ROW, CACHED_ROW), "the header's rows"
        assert (lib.KVSEAL_REFUSE_NO_PAGES, lib.KVSEAL_REFUSE_FOREIGN, lib.KVSEAL_REFUSE_UNCOVERED) == (
            REFUSE_NO_PAGES, REFUSE_FOREIGN, REFUSE_UNCOVERED), "the header's refusals"
        self.kernels = kernels
        self._struct = kernels.ffi.new("struct kvseal_records *")
        self._bound: tuple[int, ...] = ()  # what _struct describes: the tensors' addresses and sizes
        self._forward: tuple[Any, ...] = (None, None, None)  # the last writes advanced, and their pointers

    def check_forward(self, records: WriteRecords, writes: ForwardWrites, pages: torch.Tensor,
                      counts: torch.Tensor, slots: torch.Tensor) -> list[int] | None:
        num_seqs = len(writes.request_ids)  # the typed pointers refuse any dtype but int64
        if writes.rows.shape != (num_seqs,) or writes.starts.shape != (num_seqs,) or counts.shape != (2 * num_seqs,) \
                or not (writes.rows.is_contiguous() and writes.starts.is_contiguous() and pages.is_contiguous()
                        and counts.is_contiguous() and slots.is_contiguous()):
            raise ValueError("the check takes contiguous tensors: one row, start and two counts per sequence")
        refused = torch.empty(num_seqs, dtype=torch.int64)
        ptr, slot_counts = self.kernels.ptr, self.kernels.ffi.cast("int64_t *", counts.data_ptr() + 8 * num_seqs)
        num_refused = self.kernels.lib.kvseal_check_forward(
            self._records(records), ptr(writes.rows), ptr(writes.starts), num_seqs, ptr(pages), pages.numel(),
            ptr(counts), ptr(slots), slots.numel(), slot_counts, ptr(refused))
        if num_refused < 0:
            raise ValueError("the counts do not add up to the pages and slots given")
        return refused.tolist() if num_refused else None

    def advance_prefix(self, records: WriteRecords, rows: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                       layers: slice) -> None:
        known = self._forward
        if not (known[0] is rows and known[1] is starts and known[2] is ends):  # once a forward, not per report
            if not rows.shape == starts.shape == ends.shape or rows.dim() != 1 \
                    or not (rows.is_contiguous() and starts.is_contiguous() and ends.is_contiguous()):
                raise ValueError("advance_prefix takes one row, start and end per sequence, contiguous")
            ptr = self.kernels.ptr
            self._forward = (rows, starts, ends, ptr(rows), ptr(starts), ptr(ends))
        begin, end, _ = layers.indices(records.num_layers)
        self.kernels.lib.kvseal_advance_prefix(self._records(records), *self._forward[3:], rows.shape[0], begin, end)

    def _records(self, records: WriteRecords) -> Any:
        """The struct describing `records`' tensors now (re-bound when one was replaced)."""
        tensors = (records.page_row, records.page_namespace, records.row_namespace, records.prefix)
        bound = tuple(t.data_ptr() for t in tensors) + tuple(records.prefix.shape) + (records.page_size,)
        if bound != self._bound:
            _require_int64(*tensors)
            num_pages, num_rows = records.page_row.shape[0], records.row_namespace.shape[0]
            if records.page_namespace.shape != (num_pages,) or records.prefix.shape != (records.num_layers, num_rows):
                raise ValueError("the write records' tensors disagree on their sizes")
            s, ptr = self._struct, self.kernels.ptr
            s.page_row, s.page_namespace, s.row_namespace, s.prefix = (ptr(t) for t in tensors)
            s.num_pages, s.page_size, s.num_layers, s.num_rows = num_pages, records.page_size, records.num_layers, \
                num_rows
            self._bound = bound
        return self._struct


def _require_int64(*tensors: torch.Tensor) -> None:
    if any(t.dtype != torch.int64 or not t.is_contiguous() for t in tensors):
        raise TypeError("the records kernels take contiguous int64 tensors")
