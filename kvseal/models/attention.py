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
        k, v = pool.read_pages(layer, rows.pages)  # [B, P, page_size, kv_heads, head_dim]
        b = k.shape[0]
        k, v = k.view(b, -1, *k.shape[3:]), v.view(b, -1, *v.shape[3:])  # [B, P * page_size, kv_heads, head_dim]
        out[rows.token_idx] = _decode_attention(q[rows.token_idx], k, v, rows.mask)
    for span in plan.prefills:
        k, v = pool.read_pages(layer, span.pages)  # [P, page_size, kv_heads, head_dim]
        k, v = k.flatten(0, 1)[: span.context_len], v.flatten(0, 1)[: span.context_len]
        qp = q[span.token_start:span.token_end].transpose(0, 1)[None]  # [1, heads, L, head_dim]
        o = F.scaled_dot_product_attention(qp, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           attn_mask=span.mask, is_causal=span.mask is None, enable_gqa=True)
        out[span.token_start:span.token_end] = o[0].transpose(0, 1)
    return out


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """q: [B, heads, head_dim]; k, v: [B, C, kv_heads, head_dim]; mask: [B, 1, 1, C] -> [B, heads, head_dim].

    float32 uses PyTorch's fused SDPA. For bf16/fp16 the CPU SDPA kernel is several times
    slower than two batched matmuls with a float32 softmax, so those take the matmul path.
    """
    if q.dtype == torch.float32:
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, enable_gqa=True)
        return o.squeeze(2)
    b, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    qg = q.view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, kv_heads, group, head_dim]
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * head_dim**-0.5  # [B, kv_heads, group, C]
    scores.masked_fill_(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).reshape(b, num_heads, head_dim)
