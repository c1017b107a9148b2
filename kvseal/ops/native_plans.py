"""The native backend's decode plan (its own module, so the decode loop and the backend share it
without importing each other)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvseal.ops.interface import DecodePlan


@dataclass(frozen=True)
class NativeRows(DecodePlan):
    """The decode rows for the native kernel, which reads K and V in place: each row's own page
    table and context length; the kernel reads slots 0..context_len-1 only."""

    tables: torch.Tensor  # [num_decodes, max_pages] int64, each row padded with its own last page
    context_lens: torch.Tensor  # [num_decodes] int64
    max_context: int
