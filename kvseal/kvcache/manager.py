"""KV cache manager: the allocator and the pool together, in the scheduler's terms.

The scheduler asks for room in tokens; the manager turns that into whole pages, applies the
scrub policy (I7) at the two moments it can act (hand-out and take-back), and answers the
checked-mode question "was every slot this request is about to read written by it?" (I4).

Checked mode poisons pages with NaN while they are free (a read of a page the reader does
not own shows up as NaN) and zeroes them when handed out; reads of owned-but-unwritten
slots are caught by the write records before the forward runs.
"""

from __future__ import annotations

import math

import torch

from kvseal._testing.faults import Fault, is_active
from kvseal.config import CacheConfig
from kvseal.errors import IsolationViolation
from kvseal.kvcache.allocator import PageAllocator
from kvseal.kvcache.pool import KVPool


class KVCacheManager:
    def __init__(self, config: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        self.config = config
        self.page_size = config.page_size
        self.allocator = PageAllocator(config.num_pages)
        self.pool = KVPool(num_layers, config.num_pages, config.page_size, num_kv_heads, head_dim, config.dtype)
        if config.check_kv:
            self.pool.fill(list(range(config.num_pages)), float("nan"))

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free_pages

    @property
    def num_used_pages(self) -> int:
        return self.allocator.num_owned_pages

    def num_pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def num_missing_pages(self, request_id: str, num_tokens: int) -> int:
        return max(0, self.num_pages_for(num_tokens) - len(self.allocator.pages_of(request_id)))

    def can_reserve(self, request_id: str, num_tokens: int) -> bool:
        return self.allocator.can_allocate(self.num_missing_pages(request_id, num_tokens))

    def reserve(self, request_id: str, tenant: str, num_tokens: int) -> None:
        """Make the request own enough pages for `num_tokens` tokens."""
        missing = self.num_missing_pages(request_id, num_tokens)
        if not self.allocator.owns(request_id):
            new_pages = self.allocator.allocate(request_id, tenant, missing)
        else:
            new_pages = self.allocator.append(request_id, missing)
        if not new_pages:
            return
        generations = [self.allocator.owner_of(p).generation for p in new_pages]  # type: ignore[union-attr]
        self.pool.hand_out(new_pages, generations)
        if self.config.kv_scrub == "alloc" or self.config.check_kv:
            # Checked mode: zero the NaN poison on hand-out. Attention reads whole pages and
            # masks the unwritten tail, and a masked NaN would still poison the sum.
            self.pool.fill(new_pages, 0.0)

    def free(self, request_id: str) -> list[int]:
        """Release every page of the request at once, scrubbed or poisoned per config."""
        pages = self.allocator.free(request_id)
        if not pages:
            return pages
        self.pool.take_back(pages)
        if self.config.check_kv:
            self.pool.fill(pages, float("nan"))
        elif self.config.kv_scrub == "free":
            self.pool.fill(pages, 0.0)
        return pages

    def slots(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Pool slot of each position in [start, end) of the request: [end - start] int64."""
        pages = torch.tensor(self._page_table(request_id), dtype=torch.int64)
        positions = torch.arange(start, end, dtype=torch.int64)
        return pages[positions // self.page_size] * self.page_size + positions % self.page_size

    def block_table(self, request_id: str, num_tokens: int) -> torch.Tensor:
        """The request's pages covering its first `num_tokens` positions, in order."""
        return torch.tensor(self._page_table(request_id)[: self.num_pages_for(num_tokens)], dtype=torch.int64)

    def _page_table(self, request_id: str) -> list[int]:
        """The request's pages in position order: what its reads and writes go through."""
        pages = self.allocator.pages_of(request_id)
        if pages and is_active(Fault.FOREIGN_PAGE):
            # Test-only: a corrupted block table that names another request's page.
            foreign = next((p for p in range(self.allocator.num_pages)
                            if (o := self.allocator.owner_of(p)) is not None and o.request_id != request_id), None)
            pages[0] = pages[0] if foreign is None else foreign
        return pages

    def num_written_tokens(self, request_id: str) -> int:
        """How many slots of the request's pages hold KV written in their current ownership."""
        pages = self.allocator.pages_of(request_id)
        if not pages:
            return 0
        return int(self.pool.written_by_owner(self.slots(request_id, 0, len(pages) * self.page_size)).sum())

    def written_prefix(self, request_id: str) -> list[int]:
        """Per layer, how many leading positions of the request hold KV written in the current
        ownership of its pages. (Interim: the pool records layer 0 only, so every layer reports
        layer 0's prefix; the per-layer coverage records replace this.)"""
        pages = self.allocator.pages_of(request_id)
        if not pages:
            return [0] * len(self.pool.k)
        written = self.pool.written_by_owner(self.slots(request_id, 0, len(pages) * self.page_size))
        unwritten = (~written).nonzero()
        prefix = int(unwritten[0]) if unwritten.numel() else int(written.shape[0])
        return [prefix] * len(self.pool.k)

    def record_written(self, request_id: str, layer: int, start: int, end: int) -> None:
        """Record that positions [start, end) of `layer` were written into the request's own
        pages by something other than this engine's forward (a KV transport). Call it only
        after the data is in the pool."""
        if layer == 0 and end > start:
            self.pool.mark_written(self.slots(request_id, start, end))

    def verify_readable(self, request_id: str, context_slots: torch.Tensor, new_slots: torch.Tensor) -> None:
        """Checked mode (I4): every context slot must lie in a page the request owns and be
        written by it, either earlier in this ownership period or by this forward (`new_slots`)."""
        owned = set(self.allocator.pages_of(request_id))
        foreign = sorted({p for p in (context_slots // self.page_size).tolist() if p not in owned})
        if foreign:
            raise IsolationViolation(request_id, f"request {request_id} would read pages {foreign[:8]} it does not own")
        written = self.pool.written_by_owner(context_slots) | torch.isin(context_slots, new_slots)
        if not bool(written.all()):
            first = int((~written).nonzero()[0])
            raise IsolationViolation(
                request_id,
                f"request {request_id} would read {int((~written).sum())} KV slots it never wrote "
                f"(first at position {first}); refusing to run the forward",
            )

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
