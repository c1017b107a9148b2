"""Attention over the paged pool, gathering whole pages (contiguous blocks) per sequence.

Decode sequences (one new token each) run as one padded batch; prefill chunks run one at a
time with a causal mask offset by the tokens already in the cache. Padding never points at
another request's page: a decode row is padded with its own last page and masked, and slots
past a sequence's context are masked too, so even a NaN-poisoned pool (checked mode) cannot
reach the result.
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
    pages: torch.Tensor  # [num_pages]
    context_len: int
    mask: torch.Tensor | None  # [query_len, context_len] bool; None: plain causal (no cached prefix)


@dataclass(frozen=True)
class DecodeRows:
    token_idx: torch.Tensor  # [num_decodes] into the flattened tokens
    pages: torch.Tensor  # [num_decodes, max_pages]
    mask: torch.Tensor  # [num_decodes, 1, 1, max_pages * page_size] bool: slot < context_len


@dataclass(frozen=True)
class AttentionPlan:
    """Index tensors for one forward, built once and shared by every layer."""

    decode: DecodeRows | None
    prefills: list[PrefillSpan]

    @classmethod
    def build(cls, batch: ForwardBatch, page_size: int) -> AttentionPlan:
        decode_rows: list[int] = []
        prefills: list[PrefillSpan] = []
        token_start = 0
        for i, (query_len, context_len) in enumerate(zip(batch.query_lens, batch.context_lens)):
            if query_len == 1:
                decode_rows.append(i)
            else:
                prefills.append(_prefill_span(token_start, query_len, context_len, batch.block_tables[i]))
            token_start += query_len
        if not decode_rows:
            return cls(None, prefills)
        starts = torch.tensor([0, *batch.query_lens]).cumsum(0)
        token_idx = starts[torch.tensor(decode_rows)]
        pages, mask = _padded_pages([batch.block_tables[i] for i in decode_rows],
                                    [batch.context_lens[i] for i in decode_rows], page_size)
        return cls(DecodeRows(token_idx, pages, mask), prefills)


def _prefill_span(token_start: int, query_len: int, context_len: int, pages: torch.Tensor) -> PrefillSpan:
    mask = None
    if context_len != query_len:
        q_pos = torch.arange(query_len)[:, None] + (context_len - query_len)
        mask = torch.arange(context_len)[None, :] <= q_pos
    return PrefillSpan(token_start, token_start + query_len, pages, context_len, mask)


def _padded_pages(rows: list[torch.Tensor], context_lens: list[int],
                  page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    max_pages = max(int(r.shape[0]) for r in rows)
    pages = torch.stack([torch.cat([r, r[-1:].expand(max_pages - r.shape[0])]) for r in rows])
    mask = torch.arange(max_pages * page_size)[None, :] < torch.tensor(context_lens)[:, None]
    return pages, mask[:, None, None, :]


def paged_attention(q: torch.Tensor, pool: KVPool, layer: int, plan: AttentionPlan) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]."""
    out = torch.empty_like(q)
    if plan.decode is not None:
        rows = plan.decode
        k, v = pool.read_pages(layer, rows.pages)  # [kv_heads, B, P, page_size, head_dim]
        k, v = k.flatten(2, 3), v.flatten(2, 3)  # [kv_heads, B, P * page_size, head_dim]
        out[rows.token_idx] = _decode_attention(q[rows.token_idx], k, v, rows.mask)
    for span in plan.prefills:
        k, v = pool.read_pages(layer, span.pages)  # [kv_heads, P, page_size, head_dim]
        k, v = k.flatten(1, 2)[:, : span.context_len], v.flatten(1, 2)[:, : span.context_len]
        qp = q[span.token_start:span.token_end].transpose(0, 1)[None]  # [1, heads, L, head_dim]
        o = F.scaled_dot_product_attention(qp, k[None], v[None],
                                           attn_mask=span.mask, is_causal=span.mask is None, enable_gqa=True)
        out[span.token_start:span.token_end] = o[0].transpose(0, 1)
    return out


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q: [B, heads, head_dim]; k, v: [kv_heads, B, C, head_dim]; mask: [B, 1, 1, C] -> [B, heads, head_dim].

    Two batched matmuls with a float32 softmax: on CPU this beats PyTorch's SDPA with a mask
    (several times over in bf16), and the head-major pool makes K and V contiguous per head.
    """
    b, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[0]
    qg = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)  # [kv_heads, B, group, D]
    scores = torch.matmul(qg, k.transpose(2, 3)).float() * head_dim**-0.5  # [kv_heads, B, group, C]
    scores.masked_fill_(~mask.view(1, b, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(0, 1).reshape(b, num_heads, head_dim)
