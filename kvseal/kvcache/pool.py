"""The paged KV pool: per-layer K and V tensors.

Slot s lives in page s // page_size at offset s % page_size. The pool keeps no records of
who wrote what; after each layer's write it tells its observer (the KV manager's write
records, `kvcache/records.py`), so the records advance exactly when a write happened.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from kvseal.hugepages import huge_empty, huge_zeros, mapping_tensor, touch_tensors
from kvseal.kvcache.reserve import PoolGeometry, PoolReservation
from kvseal.pagemem import BackgroundTouch


class LayerWriteObserver(Protocol):
    def on_layer_write(self, layer: int, slots: torch.Tensor) -> None: ...

    def on_layers_write(self, num_layers: int, slots: torch.Tensor) -> None:
        """Layers 0..num_layers-1 each stored `slots` (one call for a whole decode step)."""


class KVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, observer: LayerWriteObserver | None = None,
                 device: str = "cpu", touch_later: bool = False, reserved: PoolReservation | None = None) -> None:
        """touch_later (CPU): the tensors are fresh mappings, which read zero, and a background
        thread commits their memory (`kvseal.pagemem.BackgroundTouch`) until `wait_touched()`,
        which must come before the pool's first use; else they are written (zeros) here.
        reserved (CPU): the tensors are the mappings of this reservation, which must be of
        exactly this pool (ValueError otherwise), committed as touch_later's are."""
        self.page_size = page_size
        self.num_pages = num_pages
        # Head-major, so that one head's context is contiguous for the attention matmuls.
        shape = (num_kv_heads, num_pages, page_size, head_dim)
        # k[layer], v[layer]: [num_kv_heads, num_pages, page_size, head_dim] on `device`; on the
        # CPU on huge pages where the kernel grants them (a decode step streams every row's
        # context: `kvseal/hugepages.py`). Tuples: a pool's tensors never change (the decode loop
        # binds their addresses once).
        self.device = torch.device(device)
        self.observer = observer
        self.reserved = reserved  # the reservation whose mappings the tensors are, if any
        self._touch: BackgroundTouch | PoolReservation | None
        if reserved is not None:
            geometry = PoolGeometry(num_layers, num_pages, page_size, num_kv_heads, head_dim,
                                    str(dtype).removeprefix("torch."))
            if reserved.geometry != geometry or self.device.type != "cpu":
                raise ValueError(f"the reservation holds {reserved.geometry}, not this pool ({geometry}, {device})")
            tensors = [mapping_tensor(m, dtype, shape) for m in reserved.mappings]
            self._touch = reserved
        else:
            later = touch_later and self.device.type == "cpu"
            tensors = [self._zeros(shape, dtype, later) for _ in range(2 * num_layers)]
            self._touch = touch_tensors(tensors) if later else None
        self.k, self.v = tuple(tensors[:num_layers]), tuple(tensors[num_layers:])

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype, later: bool) -> torch.Tensor:
        if self.device.type == "cpu":
            return huge_empty(shape, dtype) if later else huge_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def wait_touched(self) -> None:
        """Return once the pool's memory is committed (at once unless built with touch_later)."""
        if self._touch is not None:
            self._touch.wait()
            self._touch = None

    def has_geometry(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype) -> bool:
        """Whether this pool is the one these dimensions describe."""
        return (len(self.k), self.num_pages, self.page_size, self.k[0].dtype, tuple(self.k[0].shape)) == (
            num_layers, num_pages, page_size, dtype, (num_kv_heads, num_pages, page_size, head_dim))

    @property
    def num_bytes(self) -> int:
        """The pool's bytes (K and V, every layer)."""
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

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
        if self.observer is not None:
            self.observer.on_layer_write(layer, slots)

    def write_by(self, layer: int, slots: torch.Tensor, store: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Store new tokens' K/V with `store(k_layer, v_layer)`, a kernel that writes exactly
        `slots` of the layer's K and V; then record the write as `write` does."""
        store(self.k[layer], self.v[layer])
        if self.observer is not None:
            self.observer.on_layer_write(layer, slots)

    def write_layers_by(self, slots: torch.Tensor, store: Callable[[], int]) -> None:
        """Store new tokens' K/V in every layer with one call: `store()` is a kernel that writes
        exactly `slots` of layer 0's K and V, then layer 1's, and so on (computing between the
        writes), and returns how many layers it wrote. Record each of those layers as `write`
        does, also when the kernel stopped early."""
        written = store()
        if self.observer is not None and written > 0:
            self.observer.on_layers_write(written, slots)

    def read_pages(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather whole pages ([...] page ids) -> two tensors [num_kv_heads, ..., page_size, head_dim]."""
        shape = (self.k[layer].shape[0], *pages.shape, *self.k[layer].shape[2:])
        flat = pages.reshape(-1)
        k = torch.index_select(self.k[layer], 1, flat).view(shape)
        v = torch.index_select(self.v[layer], 1, flat).view(shape)
        return k, v

    def export_pages(self, layer: int, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage K and V of `pages` ([n] page ids) of one layer into two contiguous buffers
        [num_kv_heads, n, page_size, head_dim] on the pool's device: one descriptor each for a
        transport."""
        pages = pages.to(self.device, non_blocking=True)
        return (torch.index_select(self.k[layer], 1, pages).contiguous(),
                torch.index_select(self.v[layer], 1, pages).contiguous())

    def import_pages(self, layer: int, kind: str, pages: torch.Tensor, data: torch.Tensor) -> None:
        """Write a staged buffer [num_kv_heads, n, page_size, head_dim] into `pages` of one layer
        (K for kind "k", V for "v"). Records nothing: the caller does, once every write landed."""
        target = self.k[layer] if kind == "k" else self.v[layer]
        target.index_copy_(1, pages.to(self.device, non_blocking=True),
                           data.to(device=self.device, dtype=target.dtype, non_blocking=True))

    def page_shape(self) -> tuple[int, int, int]:
        """(num_kv_heads, page_size, head_dim) of one page of one layer."""
        num_kv_heads, _, page_size, head_dim = self.k[0].shape
        return num_kv_heads, page_size, head_dim

    def fill(self, pages: list[int], value: float) -> None:
        """Overwrite every slot of `pages` in every layer (scrub with 0, poison with NaN)."""
        index = torch.tensor(pages, dtype=torch.int64, device=self.device)
        for k, v in zip(self.k, self.v):
            k.index_fill_(1, index, value)
            v.index_fill_(1, index, value)
