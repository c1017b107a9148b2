"""Attention over the paged pool: which rows of a forward attend how, and the call per layer.

`AttentionPlan.build` sorts a forward's sequences once (every layer shares the plan): decode
rows (one new token each) run as one batch, each row's block table padded with its own last
page (never another request's) to the longest; prefill chunks that start at position 0 attend
only to the tokens they compute themselves, and chunks of equal length share one call; chunks
that continue a cached prefix run one at a time, over their own pages, with a causal mask offset
by the tokens already in the cache. `paged_attention` runs one layer's plan through the ops
(`kvseal/ops`: the native kernels or torch's, whichever the engine selected), each path filling
its own rows of the output. What each op may read of the pool (a row's own written slots only)
is the ops interface's contract.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from kvseal.kvcache.pool import KVPool
from kvseal.ops import DecodePlan, FreshPrefills, NewTokens, Ops, PrefillSpan
from kvseal.types import ForwardBatch


@dataclass(frozen=True)
class DecodeRows:
    """The forward's decode rows: where their tokens are, and the ops' plan for them."""

    token_idx: torch.Tensor | None  # [num_decodes] into the flattened tokens; None: every token is a decode
    plan: DecodePlan


@dataclass(frozen=True)
class AttentionPlan:
    """Index tensors for one forward, built once and shared by every layer."""

    decode: DecodeRows | None
    prefills: list[PrefillSpan]
    fresh: list[FreshPrefills]
    # the decode rows, if any, are the forward's first tokens (the scheduler puts running
    # requests first: a wave's next prompts prefill after its first ones' decode rows)
    decodes_lead: bool = True

    @classmethod
    def build(cls, batch: ForwardBatch, pool: KVPool, num_heads: int, ops: Ops) -> AttentionPlan:
        decode_rows: list[int] = []
        prefills: list[PrefillSpan] = []
        fresh_starts: dict[int, list[int]] = {}  # length -> first token of each chunk
        token_start = 0
        for i, (query_len, context_len) in enumerate(zip(batch.query_lens, batch.context_lens)):
            if query_len == 1 and context_len > 1:
                decode_rows.append(i)
            elif query_len == context_len:
                fresh_starts.setdefault(query_len, []).append(token_start)
            else:
                prefills.append(_prefill_span(token_start, query_len, context_len, batch.block_tables[i]))
            token_start += query_len
        fresh = [_fresh_group(length, starts, batch.input_ids.device) for length, starts in fresh_starts.items()]
        if not decode_rows:
            return cls(None, prefills, fresh)
        decodes_lead = decode_rows == list(range(len(decode_rows)))  # one token each: tokens 0..D-1
        token_idx = None
        if len(decode_rows) < len(batch.query_lens):
            token_idx = torch.tensor([0, *batch.query_lens]).cumsum(0)[torch.tensor(decode_rows)].to(
                batch.input_ids.device, non_blocking=True)
        context_lens = [batch.context_lens[i] for i in decode_rows]
        tables = _padded_tables([batch.block_tables[i] for i in decode_rows])
        return cls(DecodeRows(token_idx, ops.plan_decode(tables, context_lens, pool, num_heads)), prefills, fresh,
                   decodes_lead)

    @property
    def is_decode_only(self) -> bool:
        """Whether every row of the forward decodes one token."""
        return self.decode is not None and self.decode.token_idx is None and not self.prefills and not self.fresh


def _prefill_span(token_start: int, query_len: int, context_len: int, pages: torch.Tensor) -> PrefillSpan:
    q_pos = torch.arange(query_len)[:, None] + (context_len - query_len)
    mask = torch.arange(context_len)[None, :] <= q_pos
    return PrefillSpan(token_start, token_start + query_len, pages, context_len, mask,
                       torch.tensor([token_start], dtype=torch.int64))


def _fresh_group(length: int, starts: list[int], device: torch.device) -> FreshPrefills:
    first = torch.tensor(starts, dtype=torch.int64)
    on_device = first.to(device, non_blocking=True)
    if starts == list(range(starts[0], starts[0] + len(starts) * length, length)):  # back to back
        return FreshPrefills(length, None, starts[0], on_device)
    token_idx = (first[:, None] + torch.arange(length)[None, :]).reshape(-1)
    return FreshPrefills(length, token_idx.to(device, non_blocking=True), starts[0], on_device)


def _padded_tables(rows: list[torch.Tensor]) -> torch.Tensor:
    """[B, max_pages]: each row's pages padded with its own last page (never another request's)."""
    lengths = [int(r.shape[0]) for r in rows]
    if min(lengths) == max(lengths):  # nothing to pad (most decode steps): one op instead of four
        return torch.stack(rows)
    num_pages = torch.tensor(lengths)
    pages = pad_sequence(rows, batch_first=True, padding_value=-1)  # [B, max_pages]
    last = pages.gather(1, (num_pages - 1)[:, None])
    return torch.where(pages < 0, last, pages)


def paged_attention(tokens: NewTokens, pool: KVPool, layer: int, plan: AttentionPlan, ops: Ops) -> torch.Tensor:
    """One layer's attention for every token of the forward -> [T, heads, head_dim]. tokens: the
    forward's q and its K/V as written to the pool (with the fused qkv rows where they exist)."""
    q = tokens.q
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous: the kernels write rows of it
    if plan.decode is not None:
        rows = plan.decode
        if rows.token_idx is None:
            out = ops.decode_attention(q, pool, layer, rows.plan)
        else:
            out[rows.token_idx] = ops.decode_attention(q[rows.token_idx], pool, layer, rows.plan)
    if plan.fresh:
        if tokens.k.dtype != pool.k[layer].dtype:  # attend to exactly what the pool holds
            k, v = (t.to(pool.k[layer].dtype).to(q.dtype) for t in (tokens.k, tokens.v))
            tokens = NewTokens(q, k, v, None)
        ops.fresh_attention(tokens, plan.fresh, out)
    for span in plan.prefills:
        ops.prefix_attention(tokens, span, pool, layer, out)
    return out
