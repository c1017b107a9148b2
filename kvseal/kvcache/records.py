"""Write records (I3, I4): which pages each request owns, and how much of its KV is written.

Always on, at O(1) cost per sequence per step:

- `page_row[page]`: the record row of the request that owns the page (-1: free, -2: held by
  the prefix cache). One gather over a batch's block tables and slot mapping answers "does
  every page a sequence reads or writes belong to it?" (I3). A cached page may be read, never
  written, and only by a request of its namespace (`page_namespace`, `row_namespace`, I5).
- `prefix[layer, row]`: how many leading positions of that request hold KV written for that
  layer in the current ownership of its pages (I4). It only ever grows contiguously, and only
  when a write happened: the pool reports each layer's write of a forward as it happens
  (`on_layer_write`), a transport reports its writes through `record`. A forward that stopped
  after layer 0 therefore leaves layers 1.. behind. A row starts at 0 when the request gets
  its first page and is dropped when its pages are taken back (free, preemption). A request
  that starts on cached pages starts its row at their end in every layer: a page is only
  published (`publish`) once every layer's prefix covers it.

The check and the growth run in one native call each where the ops layer has them
(`RecordKernels`, passed in by the engine: kvseal/ops/csrc/records.c); otherwise, and as the
reference the native ones are tested against, in torch ops here. Both give the same answer.

Checked mode (`--check-kv`) adds per-slot, per-layer records for the deeper verification:
`slot_generation[layer, slot]` is the page generation under which the slot was last written
(-1: not since the page was handed out); a slot counts as written by the current owner only
when that equals `page_generation[page]`.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from kvseal.errors import IsolationViolation
from kvseal.types import ForwardBatch

FREE_ROW = -1
CACHED_ROW = -2  # page_row of a page held by the prefix cache
# Why the check refuses a sequence (`RecordKernels.check_forward`), in the order they are tried.
REFUSE_NO_PAGES, REFUSE_FOREIGN, REFUSE_UNCOVERED = 1, 2, 3


@dataclass(frozen=True)
class ForwardWrites:
    """What one forward writes: sequence i writes positions [starts[i], ends[i]) of
    `request_ids[i]`, whose record row is rows[i] (-1: the request holds no pages)."""

    request_ids: list[str]
    rows: torch.Tensor  # [num_seqs] int64
    starts: torch.Tensor  # [num_seqs] int64
    ends: torch.Tensor  # [num_seqs] int64


class RecordKernels(Protocol):
    """The always-on check and the prefixes' growth in one call each (the ops layer's native
    kernels). Both read and write the records' tensors as they are at the call."""

    def check_forward(self, records: WriteRecords, writes: ForwardWrites, pages: torch.Tensor,
                      counts: torch.Tensor, slots: torch.Tensor) -> list[int] | None:
        """Why each sequence of `writes` is refused (REFUSE_*, the first that applies), 0 where
        it may run; None when none is refused. pages: the block tables one after the other;
        counts [2 * num_seqs]: each table's length, then each sequence's new tokens; slots:
        the new tokens' pool slots (the batch's slot mapping)."""

    def advance_prefix(self, records: WriteRecords, rows: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor,
                       layers: slice) -> None:
        """In each of `layers`, row rows[i]'s prefix grows to ends[i] where it reaches starts[i]."""


class WriteRecords:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, track_slots: bool,
                 kernels: RecordKernels | None = None, device: str = "cpu") -> None:
        self.num_layers = num_layers
        self.kernels = kernels  # None: the check and the growth in torch ops
        self.page_size = page_size
        # Every record lives on the pool's device: the forward advances them as each layer's
        # write happens, and the check of a batch reads them, without a trip to the host.
        self.device = dev = torch.device(device)
        self.prefix = torch.zeros(num_layers, 8, dtype=torch.int64, device=dev)  # [num_layers, num_rows]; grows
        self.page_row = torch.full((num_pages,), FREE_ROW, dtype=torch.int64, device=dev)
        self.page_namespace = torch.full((num_pages,), -1, dtype=torch.int64, device=dev)  # of a cached page
        self.row_namespace = torch.full((8,), -1, dtype=torch.int64, device=dev)  # [num_rows]; grows with prefix
        # A namespace has an id while a row or a cached page carries it; ids are never reused
        # (a page of a namespace gone must never match a later one's row), so a tenant that
        # comes and goes leaves nothing here.
        self._namespace_ids: dict[str, int] = {}
        self._namespace_refs: dict[str, int] = {}  # rows and cached pages carrying each namespace
        self._next_namespace_id = 0
        self._row_namespace_of: dict[str, str] = {}  # request id -> its row's namespace
        self._cached_namespace_of: dict[int, str] = {}  # cached page -> its namespace
        self._rows: dict[str, int] = {}
        self._num_tokens_owned: dict[str, int] = {}
        self._free_rows: list[int] = list(range(7, -1, -1))
        # inside `recording`: (rows, starts, ends) of the forward's known rows, and with the
        # torch ops the next prefix [L, S] (None with the kernels, which compute it per call)
        self._forward: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
        self.track_slots = track_slots
        self.page_generation = torch.zeros(num_pages if track_slots else 0, dtype=torch.int64, device=dev)
        self.slot_generation = torch.full((num_layers, num_pages * page_size if track_slots else 0), -1,
                                          dtype=torch.int64, device=dev)

    def _index(self, values: list[int]) -> torch.Tensor:
        """An int64 index tensor on the records' device."""
        return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

    # --- ownership periods ---------------------------------------------------------------

    def hand_out(self, request_id: str, pages: list[int], generations: list[int], namespace: str = "") -> None:
        """`pages` now belong to `request_id` (appended at the end of its position order);
        nothing in them counts as written. The request's first pages start its row at 0."""
        row = self._rows.get(request_id)
        if row is None:
            row = self._open_row(request_id, namespace)
        self._num_tokens_owned[request_id] = self._num_tokens_owned.get(request_id, 0) + len(pages) * self.page_size
        index = self._index(pages)
        self.page_row[index] = row
        if self.track_slots:
            self.page_generation[index] = self._index(generations)
            self._forget_slots(index)

    def share(self, request_id: str, namespace: str, num_pages: int) -> None:
        """A request that holds nothing yet starts by reading `num_pages` cached pages: its row
        starts with them written in every layer (they were published only once complete).
        Whether the pages really are cached pages of its namespace is checked before every
        forward (`check_forward`), like every other page it names."""
        row = self._open_row(request_id, namespace)
        self._num_tokens_owned[request_id] = num_pages * self.page_size
        self.prefix[:, row] = num_pages * self.page_size

    def publish(self, request_id: str, page: int, page_index: int, namespace: str) -> None:
        """The request's own page at position index `page_index` goes to the prefix cache.

        Raises IsolationViolation unless the request owns the page and every layer's written
        prefix covers it completely: only a complete page may ever be read by another request.
        """
        row = self._rows.get(request_id)
        end = (page_index + 1) * self.page_size
        if row is None or int(self.page_row[page]) != row or int(self.prefix[:, row].min()) < end:
            raise IsolationViolation(request_id, f"request {request_id} cannot publish page {page}: it does not "
                                                 f"own it, or positions [0, {end}) are not written in every layer")
        self.page_row[page] = CACHED_ROW
        self.page_namespace[page] = self._hold_namespace(namespace)
        self._cached_namespace_of[page] = namespace

    def evict(self, pages: list[int]) -> None:
        """Cached `pages` leave the cache: free, nothing in them counts as written."""
        index = self._index(pages)
        self.page_row[index] = FREE_ROW
        self.page_namespace[index] = -1
        for page in pages:
            namespace = self._cached_namespace_of.pop(page, None)
            if namespace is not None:
                self._release_namespace(namespace)
        if self.track_slots:
            self._forget_slots(index)

    def take_back(self, request_id: str, pages: list[int]) -> None:
        """Every own page of the request is returned: its ownership period, and its row, end.
        (Cached pages it read stay cached.)"""
        index = self._index(pages)
        self.page_row[index] = FREE_ROW
        if self.track_slots:
            self._forget_slots(index)
        self._num_tokens_owned.pop(request_id, None)
        row = self._rows.pop(request_id, None)
        if row is not None:
            self.prefix[:, row] = 0
            self._free_rows.append(row)
            self._release_namespace(self._row_namespace_of.pop(request_id))

    def _open_row(self, request_id: str, namespace: str) -> int:
        assert request_id not in self._rows, f"request {request_id} already has a record row"
        row = self._rows[request_id] = self._new_row()
        self.row_namespace[row] = self._hold_namespace(namespace)
        self._row_namespace_of[request_id] = namespace
        return row

    def _hold_namespace(self, namespace: str) -> int:
        """The namespace's id (a new one if nothing carries it now), held once more."""
        if namespace not in self._namespace_ids:
            self._namespace_ids[namespace] = self._next_namespace_id
            self._next_namespace_id += 1
        self._namespace_refs[namespace] = self._namespace_refs.get(namespace, 0) + 1
        return self._namespace_ids[namespace]

    def _release_namespace(self, namespace: str) -> None:
        self._namespace_refs[namespace] -= 1
        if not self._namespace_refs[namespace]:
            del self._namespace_refs[namespace], self._namespace_ids[namespace]

    def num_namespaces(self) -> int:
        """Namespaces a row or a cached page carries now (the size of the id table)."""
        return len(self._namespace_ids)

    def _new_row(self) -> int:
        if not self._free_rows:
            num_rows = self.prefix.shape[1]
            self.prefix = torch.cat([self.prefix, torch.zeros_like(self.prefix)], dim=1)
            self.row_namespace = torch.cat([self.row_namespace, torch.full_like(self.row_namespace, -1)])
            self._free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        return self._free_rows.pop()

    def _forget_slots(self, pages: torch.Tensor) -> None:
        offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        self.slot_generation[:, (pages[:, None] * self.page_size + offsets).reshape(-1)] = -1

    # --- what was written ----------------------------------------------------------------

    def written_prefix(self, request_id: str) -> list[int]:
        """Per layer, how many leading positions of the request are written (0 if it owns nothing)."""
        row = self._rows.get(request_id)
        return [0] * self.num_layers if row is None else self.prefix[:, row].tolist()

    def record(self, request_id: str, layer: int, start: int, end: int, slots: torch.Tensor | None) -> None:
        """Contiguous growth of one layer's prefix: [start, end) was written, start == prefix.

        Raises IsolationViolation for anything else (unknown request, a gap, a rewrite, an
        empty range, a range past the pages it owns, no such layer). `slots` are the pool
        slots of [start, end), needed in checked mode only.
        """
        row = self._rows.get(request_id)
        if row is None:
            raise IsolationViolation(request_id, f"request {request_id} owns no KV pages; cannot record a write")
        if not 0 <= layer < self.num_layers:
            raise IsolationViolation(request_id, f"layer {layer} does not exist (the model has {self.num_layers})")
        written, owned = int(self.prefix[layer, row]), self._num_tokens_owned[request_id]
        if start != written or not start < end <= owned:
            raise IsolationViolation(
                request_id,
                f"request {request_id}: a write of positions [{start}, {end}) in layer {layer} is not contiguous "
                f"growth of its written prefix [0, {written}) within the {owned} positions it owns",
            )
        self.prefix[layer, row] = end
        if self.track_slots and slots is not None:
            slots = slots.to(self.device)
            self.slot_generation[layer, slots] = self.page_generation[slots // self.page_size]

    def plan(self, request_ids: list[str], starts: list[int], ends: list[int]) -> ForwardWrites:
        # one host-to-device copy for the three: [3, num_seqs]
        numbers = self._index([self._rows.get(r, -1) for r in request_ids] + starts + ends).view(3, -1)
        return ForwardWrites(request_ids, numbers[0], numbers[1], numbers[2])

    @contextlib.contextmanager
    def recording(self, writes: ForwardWrites) -> Iterator[None]:
        """While one forward runs, each layer's pool write advances that layer's prefixes.

        A sequence's prefix grows to `end` only if it already reached `start` (the write is
        contiguous); otherwise it stays, so records never claim more than was written.
        """
        if self.kernels is not None:  # they skip unknown rows and compute each layer's growth
            self._forward = writes.rows, writes.starts, writes.ends, None
        else:
            known = writes.rows >= 0
            rows, starts, ends = writes.rows[known], writes.starts[known], writes.ends[known]
            current = self.prefix.index_select(1, rows)  # [num_layers, num_seqs]
            self._forward = rows, starts, ends, torch.where(current >= starts, torch.maximum(current, ends), current)
        try:
            yield
        finally:
            self._forward = None

    def on_layer_write(self, layer: int, slots: torch.Tensor) -> None:
        """Called by the pool after it stored `slots` of `layer` (slots: [num_tokens])."""
        self._advance(slice(layer, layer + 1), slots)

    def on_layers_write(self, num_layers: int, slots: torch.Tensor) -> None:
        """`on_layer_write` for layers 0..num_layers-1 at once (the decode loop writes every
        layer in one native call): one scatter instead of one per layer."""
        self._advance(slice(0, num_layers), slots)

    def _advance(self, layers: slice, slots: torch.Tensor) -> None:
        if self._forward is not None:
            rows, starts, ends, next_prefix = self._forward
            if next_prefix is None:
                assert self.kernels is not None
                self.kernels.advance_prefix(self, rows, starts, ends, layers)
            else:
                self.prefix[layers].index_copy_(1, rows, next_prefix[layers])
        if self.track_slots:
            self.slot_generation[layers, slots] = self.page_generation[slots // self.page_size]

    # --- the always-on check ---------------------------------------------------------------

    def check_forward(self, writes: ForwardWrites, batch: ForwardBatch) -> dict[int, str]:
        """I3 + I4 for a whole batch, as batched tensor ops on the records' device, read back
        once. Returns {sequence index: why it is refused}.

        A sequence is refused if it holds no pages, if its block table names a page that is
        neither its own nor a cached page of its namespace, if its new tokens' slots name a
        page it does not own (a cached page is never written), or if some layer's written
        prefix does not reach the first position this forward writes (then [prefix, start)
        would be read unwritten). Only a refused sequence costs more (its reason is spelled
        out from the records).
        """
        if self.kernels is not None:
            return self._check_forward_native(writes, batch, self.kernels)
        pages, seq_of_page, is_read = self._batch_pages(writes, batch)
        foreign = self._foreign_pages(writes, pages, seq_of_page, is_read)  # [num_page_refs] bool
        short = self.prefix.index_select(1, writes.rows.clamp(min=0)) < writes.starts  # [num_layers, num_seqs]
        num_seqs = len(writes.request_ids)
        num_foreign = torch.zeros(num_seqs, dtype=torch.int64, device=self.device)
        num_foreign.index_add_(0, seq_of_page, foreign.long())
        # per sequence, a bit per reason: 1 holds no pages, 2 a foreign page, 4 an unwritten position
        reasons = (writes.rows < 0).long() | (num_foreign > 0).long() << 1 | short.any(0).long() << 2
        codes = reasons.tolist()  # the one read-back of the step's check
        refused: dict[int, str] = {}
        for i, code in enumerate(codes):
            if code:
                refused[i] = self._why(i, code, writes, pages, seq_of_page, foreign, short)
        return refused

    def _check_forward_native(self, writes: ForwardWrites, batch: ForwardBatch,
                              kernels: RecordKernels) -> dict[int, str]:
        tables = batch.block_tables
        pages = torch.cat(tables) if tables else torch.empty(0, dtype=torch.int64)
        counts = torch.tensor([int(t.shape[0]) for t in tables] + list(batch.query_lens), dtype=torch.int64)
        reasons = kernels.check_forward(self, writes, pages, counts, batch.slot_mapping)
        if reasons is None:
            return {}
        return {i: self._refusal(reason, i, writes, batch) for i, reason in enumerate(reasons) if reason}

    def _refusal(self, reason: int, i: int, writes: ForwardWrites, batch: ForwardBatch) -> str:
        """The message for sequence i's refusal (the torch check's words)."""
        if reason == REFUSE_NO_PAGES:
            return f"request {writes.request_ids[i]} holds no KV pages"
        if reason == REFUSE_FOREIGN:
            return self._foreign_pages_message(i, writes, batch)
        assert reason == REFUSE_UNCOVERED, f"unknown refusal {reason}"
        row, start, end = int(writes.rows[i]), int(writes.starts[i]), int(writes.ends[i])
        written = self.prefix[:, row]
        layer = int((written < start).nonzero()[0])
        return (f"request {writes.request_ids[i]} would attend to positions [0, {end}) but layer {layer} holds KV "
                f"for [0, {int(written[layer])}) and this forward writes [{start}, {end}): it would read KV slots "
                f"it never wrote")

    def _foreign_pages_message(self, i: int, writes: ForwardWrites, batch: ForwardBatch) -> str:
        row, first = int(writes.rows[i]), sum(batch.query_lens[:i])
        writes_to = (batch.slot_mapping[first:first + batch.query_lens[i]] // self.page_size).tolist()
        named = sorted({p for p in batch.block_tables[i].tolist() if not self._may_use(row, p, is_read=True)}
                       | {p for p in writes_to if not self._may_use(row, p, is_read=False)})
        return f"request {writes.request_ids[i]} would read or write pages {named[:8]} it does not own"

    def _may_use(self, row: int, page: int, is_read: bool) -> bool:
        if not 0 <= page < self.page_row.shape[0]:
            return False
        owner = int(self.page_row[page])
        return owner == row or (is_read and owner == CACHED_ROW
                                and int(self.page_namespace[page]) == int(self.row_namespace[row]))

    def _batch_pages(self, writes: ForwardWrites, batch: ForwardBatch
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every page each sequence reads (its block table), then every page it writes (its new
        slots), on the records' device: (pages, the sequence of each, whether it is a read)."""
        num_seqs = len(writes.request_ids)
        tables = torch.cat(batch.block_tables).to(self.device, non_blocking=True) if batch.block_tables \
            else torch.zeros(0, dtype=torch.int64, device=self.device)
        pages = torch.cat([tables, batch.slot_mapping.to(self.device, non_blocking=True) // self.page_size])
        counts = [int(t.shape[0]) for t in batch.block_tables] + list(batch.query_lens)
        seq_of_page = torch.arange(num_seqs).repeat(2).repeat_interleave(torch.tensor(counts, dtype=torch.int64))
        is_read = torch.arange(int(seq_of_page.shape[0])) < sum(counts[:num_seqs])
        return pages, seq_of_page.to(self.device, non_blocking=True), is_read.to(self.device, non_blocking=True)

    def _foreign_pages(self, writes: ForwardWrites, pages: torch.Tensor, seq_of_page: torch.Tensor,
                       is_read: torch.Tensor) -> torch.Tensor:
        """[num_page_refs] bool: a page that is neither the sequence's own nor (read only) a
        cached page of its namespace."""
        rows = writes.rows[seq_of_page]
        owner = self.page_row[pages]
        shared = ((owner == CACHED_ROW) & is_read
                  & (self.page_namespace[pages] == self.row_namespace[rows.clamp(min=0)]))
        return (owner != rows) & ~shared

    def _why(self, i: int, code: int, writes: ForwardWrites, pages: torch.Tensor, seq_of_page: torch.Tensor,
             foreign: torch.Tensor, short: torch.Tensor) -> str:
        request_id = writes.request_ids[i]
        if code & 1:
            return f"request {request_id} holds no KV pages"
        if code & 2:
            named = sorted(set(pages[foreign & (seq_of_page == i)].tolist()))
            return f"request {request_id} would read or write pages {named[:8]} it does not own"
        layer = int(short[:, i].nonzero()[0])
        start, end = int(writes.starts[i]), int(writes.ends[i])
        have = int(self.prefix[layer, int(writes.rows[i])])
        return (f"request {request_id} would attend to positions [0, {end}) but layer {layer} holds KV for "
                f"[0, {have}) and this forward writes [{start}, {end}): it would read KV slots it never wrote")

    def check_integrity(self, pages_of: dict[str, tuple[list[int], list[int]]], cached: dict[int, str]) -> None:
        """The records agree with the allocator: each owned page names its owner's row, each
        cached page the cache and its namespace, free pages none, and no prefix reaches past
        the pages its request holds. `pages_of`: request id -> (shared pages, own pages)."""
        holders = {r: p for r, p in pages_of.items() if p[0] or p[1]}
        assert set(self._rows) == set(holders), "write records and allocator disagree on who holds pages"
        expected = torch.full_like(self.page_row, FREE_ROW, device="cpu")
        expected_namespace = torch.full_like(self.page_namespace, -1, device="cpu")
        for page, namespace in cached.items():
            expected[page] = CACHED_ROW
            expected_namespace[page] = self._namespace_ids.get(namespace, -2)
        for request_id, (shared, pages) in holders.items():
            expected[torch.tensor(pages, dtype=torch.int64)] = self._rows[request_id]
            owned = (len(shared) + len(pages)) * self.page_size
            assert self._num_tokens_owned[request_id] == owned, f"{request_id}: owned positions disagree"
            assert int(self.prefix[:, self._rows[request_id]].max()) <= owned, f"{request_id}: prefix past its pages"
        assert torch.equal(expected, self.page_row.cpu()), "a page's owner row disagrees with the allocator"
        assert torch.equal(expected_namespace, self.page_namespace.cpu()), "a cached page's namespace disagrees"
        assert self._cached_namespace_of == cached, "cached pages' namespaces disagree with the allocator"
        carried = Counter(self._row_namespace_of.values()) + Counter(cached.values())
        assert self._namespace_refs == dict(carried), "a namespace's count of rows and cached pages is off"
        assert set(self._namespace_ids) == set(carried), "a namespace id is kept that nothing carries"

    # --- checked mode ----------------------------------------------------------------------

    def unwritten_slots(self, context_slots: torch.Tensor, new_slots: torch.Tensor) -> torch.Tensor:
        """Checked mode: [num_layers, num_context] bool, True where a context slot was neither
        written in its page's current ownership period nor is written by this forward."""
        context_slots, new_slots = context_slots.to(self.device), new_slots.to(self.device)
        owner_wrote = self.slot_generation[:, context_slots] == self.page_generation[context_slots // self.page_size]
        return ~(owner_wrote | torch.isin(context_slots, new_slots))
