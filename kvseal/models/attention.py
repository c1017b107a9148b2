"""Attention over the paged pool.

Decode sequences (one new token each) run as one padded batch; prefill chunks run one at a
time with a causal mask offset by the tokens already in the cache. Padding never points at
another request's slot: a decode row is padded with its own last context slot and masked, so
even a NaN-poisoned pool (checked mode) cannot leak into the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvseal.kvcache.pool import KVPool
from kvseal.types import ForwardBatch


@dataclass(frozen=True)
class PrefillSpan:
    token_start: int
    token_end: int
    context_slots: torch.Tensor  # [context_len]
    mask: torch.Tensor | None  # [query_len, context_len] bool; None: plain causal (no cached prefix)


@dataclass(frozen=True)
class AttentionPlan:
    """Index tensors for one forward, built once and shared by every layer."""

    decode_token_idx: torch.Tensor | None  # [num_decodes]
    decode_slots: torch.Tensor | None  # [num_decodes, max_context_len]
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context_len] bool
    prefills: list[PrefillSpan]

    @classmethod
    def build(cls, batch: ForwardBatch) -> AttentionPlan:
        decode_rows: list[int] = []
        prefills: list[PrefillSpan] = []
        token_start = 0
        for i, (query_len, context_len) in enumerate(zip(batch.query_lens, batch.context_lens)):
            if query_len == 1:
                decode_rows.append(i)
            else:
                prefills.append(_prefill_span(token_start, query_len, context_len, batch.context_slots[i]))
            token_start += query_len
        if not decode_rows:
            return cls(None, None, None, prefills)
        starts = torch.tensor([0, *batch.query_lens]).cumsum(0)
        token_idx = starts[torch.tensor(decode_rows)]
        slots, mask = _padded_slots([batch.context_slots[i] for i in decode_rows])
        return cls(token_idx, slots, mask, prefills)


def _prefill_span(token_start: int, query_len: int, context_len: int, slots: torch.Tensor) -> PrefillSpan:
    mask = None
    if context_len != query_len:
        offset = context_len - query_len
        q_pos = torch.arange(query_len)[:, None] + offset
        mask = torch.arange(context_len)[None, :] <= q_pos
    return PrefillSpan(token_start, token_start + query_len, slots, mask)


def _padded_slots(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    max_len = max(int(r.shape[0]) for r in rows)
    slots = torch.empty((len(rows), max_len), dtype=torch.int64)
    mask = torch.zeros((len(rows), max_len), dtype=torch.bool)
    for i, row in enumerate(rows):
        n = int(row.shape[0])
        slots[i, :n] = row
        slots[i, n:] = row[-1]
        mask[i, :n] = True
    return slots, mask[:, None, None, :]


def paged_attention(q: torch.Tensor, pool: KVPool, layer: int, plan: AttentionPlan) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]."""
    out = torch.empty_like(q)
    if plan.decode_token_idx is not None:
        k, v = pool.read(layer, plan.decode_slots)  # [B, C, kv_heads, head_dim]
        qd = q[plan.decode_token_idx].unsqueeze(2)  # [B, heads, 1, head_dim]
        o = F.scaled_dot_product_attention(qd, k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=plan.decode_mask, enable_gqa=True)
        out[plan.decode_token_idx] = o.squeeze(2)
    for span in plan.prefills:
        k, v = pool.read(layer, span.context_slots)  # [C, kv_heads, head_dim]
        qp = q[span.token_start:span.token_end].transpose(0, 1)[None]  # [1, heads, L, head_dim]
        o = F.scaled_dot_product_attention(qp, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=span.mask, is_causal=span.mask is None, enable_gqa=True)
        out[span.token_start:span.token_end] = o[0].transpose(0, 1)
    return out
