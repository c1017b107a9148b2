"""The paged KV pool: per-layer K and V tensors plus a record of who wrote each slot.

Slot s lives in page s // page_size at offset s % page_size. `slot_generation[s]` is the
generation of the page's ownership period in which slot s was last written (-1: not written
since the page was last handed out). A slot may be read by a request only when that value
equals the page's current generation, i.e. the current owner wrote it (I4).
"""

from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        # Head-major, so that one head's context is contiguous for the attention matmuls.
        shape = (num_kv_heads, num_pages, page_size, head_dim)
        # k[layer], v[layer]: [num_kv_heads, num_pages, page_size, head_dim]
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.page_generation = torch.zeros(num_pages, dtype=torch.int64)
        self.slot_generation = torch.full((num_pages * page_size,), -1, dtype=torch.int64)

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V. k, v: [num_tokens, num_kv_heads, head_dim]; slots: [num_tokens]."""
        # index_copy_/index_select along dim 1 are several times faster than advanced indexing there.
        num_kv_heads, head_dim = k.shape[1:]
        dtype = self.k[layer].dtype
        self.k[layer].view(num_kv_heads, self.num_slots, head_dim).index_copy_(1, slots, k.transpose(0, 1).to(dtype))
        self.v[layer].view(num_kv_heads, self.num_slots, head_dim).index_copy_(1, slots, v.transpose(0, 1).to(dtype))
        if layer == 0:
            self.slot_generation[slots] = self.page_generation[slots // self.page_size]

    def read_pages(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather whole pages ([...] page ids) -> two tensors [num_kv_heads, ..., page_size, head_dim]."""
        shape = (self.k[layer].shape[0], *pages.shape, *self.k[layer].shape[2:])
        flat = pages.reshape(-1)
        k = torch.index_select(self.k[layer], 1, flat).view(shape)
        v = torch.index_select(self.v[layer], 1, flat).view(shape)
        return k, v

    def export_pages(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage K and V of `pages` ([n] page ids) of one layer into two contiguous buffers
        [num_kv_heads, n, page_size, head_dim]: one descriptor each for a transport."""
        return (torch.index_select(self.k[layer], 1, pages).contiguous(),
                torch.index_select(self.v[layer], 1, pages).contiguous())

    def import_pages(self, layer: int, kind: str, pages: torch.Tensor, data: torch.Tensor) -> None:
        """Write a staged buffer [num_kv_heads, n, page_size, head_dim] into `pages` of one layer
        (K for kind "k", V for "v"). Records nothing: the caller does, once every write landed."""
        target = self.k[layer] if kind == "k" else self.v[layer]
        target.index_copy_(1, pages, data.to(target.dtype))

    def page_shape(self) -> tuple[int, int, int]:
        """(num_kv_heads, page_size, head_dim) of one page of one layer."""
        num_kv_heads, _, page_size, head_dim = self.k[0].shape
        return num_kv_heads, page_size, head_dim

    def mark_written(self, slots: torch.Tensor) -> None:
        """Record `slots` as written by their pages' current owners (KV that arrived by transport)."""
        self.slot_generation[slots] = self.page_generation[slots // self.page_size]

    def hand_out(self, pages: list[int], generations: list[int]) -> None:
        """Record a new ownership period for `pages`; nothing in them counts as written."""
        index = torch.tensor(pages, dtype=torch.int64)
        self.page_generation[index] = torch.tensor(generations, dtype=torch.int64)
        self._forget_writes(index)

    def take_back(self, pages: list[int]) -> None:
        index = torch.tensor(pages, dtype=torch.int64)
        self._forget_writes(index)

    def fill(self, pages: list[int], value: float) -> None:
        """Overwrite every slot of `pages` in every layer (scrub with 0, poison with NaN)."""
        index = torch.tensor(pages, dtype=torch.int64)
        for k, v in zip(self.k, self.v):
            k.index_fill_(1, index, value)
            v.index_fill_(1, index, value)

    def written_by_owner(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool per slot: was it written in its page's current ownership period?"""
        return self.slot_generation[slots] == self.page_generation[slots // self.page_size]

    def _forget_writes(self, pages: torch.Tensor) -> None:
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        self.slot_generation[(pages[:, None] * self.page_size + offsets).reshape(-1)] = -1
