"""Attention over the paged pool in torch ops (`TorchOps`, and `NativeOps` where no kernel applies).

Decode rows run as one padded batch over gathered whole pages: batched matmuls with a float32
softmax (on CPU several times faster than SDPA with a mask, in bf16 especially), the scale
applied to q (B x H values) rather than to the scores. A row is padded with its own last page
and masked, and slots past its context are masked too, so even a NaN-poisoned pool (checked
mode) cannot reach the scores. A float32 pool reads V in place (`ValueBags`), whose padding
names only the row's own first, written slot; other dtypes gather V like K and zero the slots
past each context before the PV product (0 x NaN would still reach the sum).

Fresh chunks of one length share one causal SDPA call over their own new K/V; a chunk after a
cached prefix runs SDPA over its sequence's gathered pages with a causal mask offset by the
prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvseal.kvcache.pool import KVPool
from kvseal.ops.interface import DecodePlan, FreshPrefills, NewTokens, PrefillSpan


@dataclass(frozen=True)
class ValueBags:
    """The decode rows' V read in place: one embedding bag per (kv head, row, query head of
    the group) over a layer's V table `pool.v[layer].view(-1, head_dim)`, whose weights are
    that head's attention probabilities. `embedding_bag` sums the weighted rows without
    copying them out of the pool, where a gather would copy every row's whole context per
    layer and the PV matmul would read the copy again.

    Each bag has max_pages * page_size entries, one per probability column: a row's context
    slots, then padding that points at the row's own first slot (written, so finite) with
    probability exactly 0 (masked). No bag names another request's slot or an unwritten one."""

    rows: torch.Tensor  # [num_kv_heads * num_decodes * group * max_slots] rows of the V table
    offsets: torch.Tensor  # [num_kv_heads * num_decodes * group]: where each bag starts in `rows`

    @classmethod
    def build(cls, pages: torch.Tensor, context_lens: list[int], pool: KVPool, group: int) -> ValueBags:
        # pages: [B, max_pages], each row padded with its own last page
        num_kv_heads, page_size, _ = pool.page_shape()
        num_rows, max_slots = pages.shape[0], pages.shape[1] * page_size
        slots = (pages[:, :, None] * page_size + torch.arange(page_size)).reshape(num_rows, max_slots)
        slots = torch.where(torch.arange(max_slots)[None, :] < torch.tensor(context_lens)[:, None], slots, slots[:, :1])
        head_base = torch.arange(num_kv_heads)[:, None, None, None] * pool.num_slots
        rows = (head_base + slots[None, :, None, :]).expand(num_kv_heads, num_rows, group, max_slots)
        offsets = torch.arange(0, rows.numel(), max_slots)
        return cls(rows.reshape(-1), offsets)

    def weighted_sum(self, pool: KVPool, layer: int, probs: torch.Tensor) -> torch.Tensor:
        """probs: [num_kv_heads, B, group, max_slots] (pool dtype) -> [num_kv_heads, B, group, head_dim]."""
        values = pool.v[layer].view(-1, pool.v[layer].shape[-1])  # [num_kv_heads * num_slots, head_dim]
        out = F.embedding_bag(self.rows, values, self.offsets, mode="sum", per_sample_weights=probs.reshape(-1))
        return out.view(probs.shape[:3] + (values.shape[1],))


@dataclass(frozen=True)
class GatheredRows(DecodePlan):
    """The decode rows for the torch formulation."""

    pages: torch.Tensor  # [num_decodes * max_pages]: each row's pages, padded with its own last page
    masked_out: torch.Tensor  # [1, num_decodes, 1, max_pages * page_size] bool: slot >= context_len
    # This forward's gather targets, [num_kv_heads, num_decodes * max_pages, page_size, head_dim]:
    # every layer overwrites them with its own pages (one layer's attention has finished with
    # them before the next layer gathers), so a step allocates them once, not once per layer.
    # V is gathered only when `value_bags` is None (a pool that is not float32).
    k_pages: torch.Tensor
    v_pages: torch.Tensor | None
    value_bags: ValueBags | None

    @classmethod
    def build(cls, tables: torch.Tensor, context_lens: list[int], pool: KVPool, num_heads: int) -> GatheredRows:
        num_kv_heads, page_size, head_dim = pool.page_shape()
        masked_out = torch.arange(tables.shape[1] * page_size)[None, :] >= torch.tensor(context_lens)[:, None]
        buffer_shape = (num_kv_heads, tables.numel(), page_size, head_dim)
        k_pages = torch.empty(buffer_shape, dtype=pool.k[0].dtype)
        # float32 only: embedding_bag's fast weighted sum; other dtypes keep the gather + matmul
        if pool.v[0].dtype == torch.float32:
            v_pages, value_bags = None, ValueBags.build(tables, context_lens, pool, num_heads // num_kv_heads)
        else:
            v_pages, value_bags = torch.empty(buffer_shape, dtype=pool.v[0].dtype), None
        return cls(tables.reshape(-1), masked_out[None, :, None, :], k_pages, v_pages, value_bags)

    def gather(self, pool: KVPool, layer: int, buffer: torch.Tensor,
               source: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The rows' pages of `layer` of `source` (pool.k or pool.v) ->
        [num_kv_heads, num_decodes, max_pages * page_size, head_dim]."""
        torch.index_select(source[layer], 1, self.pages, out=buffer)
        num_kv_heads, _, page_size, head_dim = buffer.shape
        return buffer.view(num_kv_heads, self.masked_out.shape[1], -1, head_dim)


def decode_attention(q: torch.Tensor, pool: KVPool, layer: int, rows: GatheredRows) -> torch.Tensor:
    """q: [B, heads, head_dim] -> [B, heads, head_dim], over the rows' pages of `layer`."""
    b, num_heads, head_dim = q.shape
    k = rows.gather(pool, layer, rows.k_pages, pool.k)  # [kv_heads, B, C, head_dim]
    num_kv_heads = k.shape[0]
    qg = (q * head_dim**-0.5).view(b, num_kv_heads, num_heads // num_kv_heads, head_dim).transpose(0, 1)
    scores = torch.matmul(qg, k.transpose(2, 3)).float()  # [kv_heads, B, group, C]
    scores.masked_fill_(rows.masked_out, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(pool.v[layer].dtype)
    if rows.value_bags is not None:
        out = rows.value_bags.weighted_sum(pool, layer, probs)  # [kv_heads, B, group, head_dim]
    else:
        assert rows.v_pages is not None
        # slots past a row's context (stale values of the page's earlier owner, or padding) are
        # zeroed: their weight is 0, but 0 x inf or NaN would still reach the sum
        v = rows.gather(pool, layer, rows.v_pages, pool.v).masked_fill_(rows.masked_out[:, :, 0, :, None], 0)
        out = torch.matmul(probs, v)
    return out.transpose(0, 1).reshape(b, num_heads, head_dim)


def fresh_attention(tokens: NewTokens, groups: Sequence[FreshPrefills], out: torch.Tensor) -> None:
    """Causal attention of chunks that start at position 0 over their own new K/V: one SDPA call
    per group (chunks of one length)."""
    q, k, v = tokens.q, tokens.k, tokens.v
    heads, head_dim = q.shape[1], q.shape[2]
    for group in groups:
        length, num_chunks = group.length, group.starts.numel()
        picked = group.rows()  # a span: views of the chunks' rows, not copies
        qs, ks, vs = (t[picked].view(num_chunks, length, t.shape[1], head_dim).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)  # [n, heads, L, head_dim]
        out[picked] = o.transpose(1, 2).reshape(-1, heads, head_dim)


def prefix_attention(tokens: NewTokens, span: PrefillSpan, pool: KVPool, layer: int, out: torch.Tensor) -> None:
    """SDPA of the span's queries over its sequence's gathered pages, slots 0..context_len-1."""
    k, v = pool.read_pages(layer, span.pages)  # [kv_heads, P, page_size, head_dim]
    k, v = k.flatten(1, 2)[:, : span.context_len], v.flatten(1, 2)[:, : span.context_len]
    qp = tokens.q[span.token_start:span.token_end].transpose(0, 1)[None]  # [1, heads, L, head_dim]
    o = F.scaled_dot_product_attention(qp, k[None], v[None], attn_mask=span.mask, enable_gqa=True)
    out[span.token_start:span.token_end] = o[0].transpose(0, 1)
