"""Attention over the paged pool, gathering whole pages (contiguous blocks) per sequence.

Decode sequences (one new token each) run as one padded batch; prefill chunks that continue
a cached prefix run one at a time with a causal mask offset by the tokens already in the
cache: the native prefill kernel over the chunk's own rows and its sequence's own pool slots
(`AttentionPlan.span_kernel`, `native.CachedPrefix`) where it applies, else SDPA over the
gathered pages. Padding never points at another request's page: a decode row is padded with
its own last page and masked, and slots past a sequence's context are masked too, so even a
NaN-poisoned pool (checked mode) cannot reach the scores. In a float32 or bfloat16 pool decode
runs the native kernel (`models/native.py`: K and V read in place through each row's own block
table, slots 0..context_len-1 only) when it could be built; otherwise a float32 pool reads V in
place (`ValueBags`), whose padding names only the row's own first, written slot, and gathers K,
and other dtypes gather both.

A prefill chunk that starts at position 0 attends only to the tokens it computes itself: it
uses the K/V of this forward directly (the same values it just wrote to its own pages; the
pool has the activations' dtype) instead of reading them back, and chunks of equal length
share one causal attention call. In the native forward that call is the native kernel
(`models/native.py`), which reads each chunk's own rows of the fused qkv projection in place
and writes its output rows. A bfloat16 forward runs its bfloat16 twin (scores by AVX512-BF16
dot products) where the build has one, else hands the float32 kernel the rows widened once per
layer (exact) and rounds its output rows once; either takes under half of SDPA's bfloat16 time
on CPUs without AMX (docs/BENCHMARKS.md, round 11). On CPUs whose AMX runs the tile linears,
SDPA multiplies on AMX and is the faster (round 20): a bfloat16 forward there gathers the
chunks' q/k/v into one causal SDPA call, as does any forward without a kernel (another dtype,
head_dim not a multiple of 8).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from kvseal.kvcache.pool import KVPool
from kvseal.models.native import (
    CachedPrefix,
    decode_attention_kernel,
    prefill_attention_kernel,
    run_decode_attention,
    run_prefill_attention,
    sdpa_leads_fresh_prefill,
)
from kvseal.types import ForwardBatch


@dataclass(frozen=True)
class PrefillSpan:
    """A prefill chunk after a cached prefix: reads its whole context from its pages."""

    token_start: int
    token_end: int
    pages: torch.Tensor  # [num_pages]
    context_len: int
    mask: torch.Tensor  # [query_len, context_len] bool
    starts: torch.Tensor  # [1] int64: token_start, for the native kernel


@dataclass(frozen=True)
class FreshPrefills:
    """Chunks starting at position 0, all `length` tokens long: one causal attention call."""

    length: int
    # [num_chunks * length] into the flattened tokens; None: the chunks lie back to back from
    # token_start (one chunk, or several in a row), so their tokens are one span, viewed not gathered
    token_idx: torch.Tensor | None
    token_start: int
    starts: torch.Tensor  # [num_chunks] int64: each chunk's first token
    # The native kernel (a float32 or bfloat16 pool and a built library); None: SDPA over
    # gathered q/k/v.
    # It runs only where the forward hands over its fused qkv rows (`paged_attention`).
    kernel: Callable[..., int] | None = None
    kernel_dtype: torch.dtype = torch.float32  # the rows it takes (float32 for a bfloat16 pool: widened)

    def rows(self) -> slice | torch.Tensor:
        """The group's tokens: one span, or their indices."""
        if self.token_idx is None:
            return slice(self.token_start, self.token_start + self.starts.numel() * self.length)
        return self.token_idx


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
class NativeRows:
    """The decode rows for the native kernel (`models/native.py`), which reads K and V in place:
    each row's own page table and context length; the kernel reads slots 0..context_len-1 only."""

    kernel: Callable[..., int]
    tables: torch.Tensor  # [num_decodes, max_pages] int64, each row padded with its own last page
    context_lens: torch.Tensor  # [num_decodes] int64
    max_context: int


@dataclass(frozen=True)
class DecodeRows:
    token_idx: torch.Tensor | None  # [num_decodes] into the flattened tokens; None: every token is a decode
    pages: torch.Tensor  # [num_decodes * max_pages]: each row's pages, padded with its own last page
    masked_out: torch.Tensor  # [1, num_decodes, 1, max_pages * page_size] bool: slot >= context_len
    # This forward's gather targets, [num_kv_heads, num_decodes * max_pages, page_size, head_dim]:
    # every layer overwrites them with its own pages (one layer's attention has finished with
    # them before the next layer gathers), so a step allocates them once, not once per layer.
    # V is gathered only when `value_bags` is None (a pool that is not float32). None of them
    # exists when `native` is set: the kernel reads the pool in place.
    k_pages: torch.Tensor | None
    v_pages: torch.Tensor | None
    value_bags: ValueBags | None
    native: NativeRows | None = None

    def gather(self, pool: KVPool, layer: int, buffer: torch.Tensor, source: list[torch.Tensor]) -> torch.Tensor:
        """The rows' pages of `layer` of `source` (pool.k or pool.v) ->
        [num_kv_heads, num_decodes, max_pages * page_size, head_dim]."""
        torch.index_select(source[layer], 1, self.pages, out=buffer)
        num_kv_heads, _, page_size, head_dim = buffer.shape
        return buffer.view(num_kv_heads, self.masked_out.shape[1], -1, head_dim)


@dataclass(frozen=True)
class AttentionPlan:
    """Index tensors for one forward, built once and shared by every layer."""

    decode: DecodeRows | None
    prefills: list[PrefillSpan]
    fresh: list[FreshPrefills]
    # the native prefill kernel over the pool's dtype for chunks after a cached prefix (one
    # call each: the chunk's rows of qkv and its own pool slots); None: SDPA over gathered pages
    span_kernel: Callable[..., int] | None = None

    @classmethod
    def build(cls, batch: ForwardBatch, pool: KVPool, num_heads: int) -> AttentionPlan:
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
        # the kernel over the pool's dtype; a bfloat16 pool without it: the float32 one on widened
        # rows; SDPA where it is the faster (bfloat16 on AMX for head dims the tile kernel skips)
        dtype = pool.k[0].dtype
        fresh_kernel = None
        if fresh_starts and not sdpa_leads_fresh_prefill(dtype, pool.page_shape()[2]):
            fresh_kernel = prefill_attention_kernel(dtype)
            if fresh_kernel is None and dtype == torch.bfloat16:
                fresh_kernel, dtype = prefill_attention_kernel(torch.float32), torch.float32
        fresh = [_fresh_group(length, starts, fresh_kernel, dtype) for length, starts in fresh_starts.items()]
        span_kernel = prefill_attention_kernel(pool.k[0].dtype) if prefills else None
        if not decode_rows:
            return cls(None, prefills, fresh, span_kernel)
        token_idx = None
        if len(decode_rows) < len(batch.query_lens):
            token_idx = torch.tensor([0, *batch.query_lens]).cumsum(0)[torch.tensor(decode_rows)]
        context_lens = [batch.context_lens[i] for i in decode_rows]
        pages, masked_out = _padded_pages([batch.block_tables[i] for i in decode_rows], context_lens, pool.page_size)
        kernel = decode_attention_kernel(pool.k[0].dtype)
        if kernel is not None:
            native = NativeRows(kernel, pages, torch.tensor(context_lens, dtype=torch.int64), max(context_lens))
            return cls(DecodeRows(token_idx, pages.reshape(-1), masked_out, None, None, None, native), prefills, fresh,
                       span_kernel)
        num_kv_heads, page_size, head_dim = pool.page_shape()
        buffer_shape = (num_kv_heads, pages.numel(), page_size, head_dim)
        k_pages = torch.empty(buffer_shape, dtype=pool.k[0].dtype)
        # float32 only: embedding_bag's fast weighted sum; other dtypes keep the gather + matmul
        if pool.v[0].dtype == torch.float32:
            v_pages, value_bags = None, ValueBags.build(pages, context_lens, pool, num_heads // num_kv_heads)
        else:
            v_pages, value_bags = torch.empty(buffer_shape, dtype=pool.v[0].dtype), None
        decode = DecodeRows(token_idx, pages.reshape(-1), masked_out, k_pages, v_pages, value_bags)
        return cls(decode, prefills, fresh, span_kernel)


def _prefill_span(token_start: int, query_len: int, context_len: int, pages: torch.Tensor) -> PrefillSpan:
    q_pos = torch.arange(query_len)[:, None] + (context_len - query_len)
    mask = torch.arange(context_len)[None, :] <= q_pos
    return PrefillSpan(token_start, token_start + query_len, pages, context_len, mask,
                       torch.tensor([token_start], dtype=torch.int64))


def _fresh_group(length: int, starts: list[int], kernel: Callable[..., int] | None,
                 kernel_dtype: torch.dtype) -> FreshPrefills:
    first = torch.tensor(starts, dtype=torch.int64)
    if starts == list(range(starts[0], starts[0] + len(starts) * length, length)):  # back to back
        return FreshPrefills(length, None, starts[0], first, kernel, kernel_dtype)
    token_idx = (first[:, None] + torch.arange(length)[None, :]).reshape(-1)
    return FreshPrefills(length, token_idx, starts[0], first, kernel, kernel_dtype)


def _padded_pages(rows: list[torch.Tensor], context_lens: list[int],
                  page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row padded with its own last page (never another request's), and which slots
    each row must not attend to (past its context)."""
    num_pages = torch.tensor([int(r.shape[0]) for r in rows])
    pages = pad_sequence(rows, batch_first=True, padding_value=-1)  # [B, max_pages]
    last = pages.gather(1, (num_pages - 1)[:, None])
    pages = torch.where(pages < 0, last, pages)
    masked_out = torch.arange(pages.shape[1] * page_size)[None, :] >= torch.tensor(context_lens)[:, None]
    return pages, masked_out[None, :, None, :]


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, pool: KVPool, layer: int,
                    plan: AttentionPlan, qkv: torch.Tensor | None = None) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; k_new, v_new: this forward's K/V as written to the
    pool, [num_tokens, num_kv_heads, head_dim] -> [num_tokens, num_heads, head_dim].

    qkv: the fused rows that q, k_new and v_new are views of (`Attention.forward_native`:
    [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], contiguous, after RoPE), or None.
    With it, fresh chunks run the native kernel on those rows in place where it applies."""
    out = torch.empty(q.shape, dtype=q.dtype)  # contiguous: the native kernels write rows of it
    if plan.decode is not None:
        rows = plan.decode
        if rows.token_idx is None:
            out = _decode_attention(q, pool, layer, rows)
        else:
            out[rows.token_idx] = _decode_attention(q[rows.token_idx], pool, layer, rows)
    if plan.fresh and k_new.dtype != pool.k[layer].dtype:  # attend to exactly what the pool holds
        k_new, v_new = (t.to(pool.k[layer].dtype).to(q.dtype) for t in (k_new, v_new))
    widened: tuple[torch.Tensor, torch.Tensor] | None = None  # a bfloat16 forward's qkv and out in float32
    for group in plan.fresh:
        if qkv is not None and _fresh_runs_native(q, k_new, v_new, qkv, group):
            assert group.kernel is not None
            if qkv.dtype != group.kernel_dtype and widened is None:
                widened = qkv.float(), torch.empty(out.shape, dtype=torch.float32)
            fused, fused_out = (qkv, out) if widened is None else widened
            # Isolation: the kernel reads each chunk's own rows of qkv only (the tokens of this
            # forward of that same sequence, positions 0..length-1), never the pool.
            run_prefill_attention(group.kernel, fused, group.starts, group.length, q.shape[1], k_new.shape[1],
                                  q.shape[2], fused_out)
            if widened is not None:  # the group's rows, rounded once
                picked = group.rows()
                out[picked] = fused_out[picked].to(out.dtype)
        else:
            _fresh_attention(q, k_new, v_new, group, out)
    for span in plan.prefills:
        if plan.span_kernel is not None and qkv is not None and qkv.dtype == pool.k[layer].dtype \
                and _fused_rows(q, k_new, v_new, qkv):
            # Isolation: the kernel reads this chunk's own rows of qkv and its sequence's own
            # pool slots 0..prefix-1 (through span.pages), nothing else.
            query_len = span.token_end - span.token_start
            cached = CachedPrefix(span.context_len - query_len, span.pages, pool.k[layer], pool.v[layer])
            run_prefill_attention(plan.span_kernel, qkv, span.starts, query_len, q.shape[1], k_new.shape[1],
                                  q.shape[2], out, cached)
            continue
        k, v = pool.read_pages(layer, span.pages)  # [kv_heads, P, page_size, head_dim]
        k, v = k.flatten(1, 2)[:, : span.context_len], v.flatten(1, 2)[:, : span.context_len]
        qp = q[span.token_start:span.token_end].transpose(0, 1)[None]  # [1, heads, L, head_dim]
        o = F.scaled_dot_product_attention(qp, k[None], v[None], attn_mask=span.mask, enable_gqa=True)
        out[span.token_start:span.token_end] = o[0].transpose(0, 1)
    return out


def _fresh_runs_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv: torch.Tensor,
                       group: FreshPrefills) -> bool:
    """Whether the native kernel applies: a kernel in the plan (float32 or bfloat16 pool) and
    rows it takes (`_fused_rows`)."""
    return group.kernel is not None and _fused_rows(q, k, v, qkv)


def _fused_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qkv: torch.Tensor) -> bool:
    """Whether the native prefill kernel takes these rows: float32 or bfloat16, head_dim a
    multiple of 8, and q, k, v the q / K / V column blocks of the qkv rows."""
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    if qkv.dtype not in (torch.float32, torch.bfloat16) or k.dtype != qkv.dtype or not qkv.is_contiguous() \
            or head_dim % 8:
        return False
    base, size = qkv.data_ptr(), qkv.element_size()
    assert qkv.shape[1] == (heads + 2 * kv_heads) * head_dim and q.data_ptr() == base \
        and k.data_ptr() == base + size * heads * head_dim \
        and v.data_ptr() == base + size * (heads + kv_heads) * head_dim, "q, k, v are the column blocks of the qkv rows"
    return True


def _fresh_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: FreshPrefills,
                     out: torch.Tensor) -> None:
    """Causal attention of chunks that start at position 0 over their own new K/V."""
    length, heads, head_dim, num_chunks = group.length, q.shape[1], q.shape[2], group.starts.numel()
    picked = group.rows()  # a span: views of the chunks' rows, not copies
    qs, ks, vs = (t[picked].view(num_chunks, length, t.shape[1], head_dim).transpose(1, 2) for t in (q, k, v))
    o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)  # [n, heads, L, head_dim]
    out[picked] = o.transpose(1, 2).reshape(-1, heads, head_dim)


def _decode_attention(q: torch.Tensor, pool: KVPool, layer: int, rows: DecodeRows) -> torch.Tensor:
    """q: [B, heads, head_dim] -> [B, heads, head_dim], over the rows' pages of `layer`.

    Batched matmuls with a float32 softmax: on CPU this beats PyTorch's SDPA with a mask
    (several times over in bf16), and the head-major pool makes K and V contiguous per head.
    The scale is applied to q (B x heads values) rather than to the scores. In float32 the
    PV product reads V in place (`ValueBags`); other dtypes gather V like K. With `rows.native`
    set (a float32 or bfloat16 pool and a built kernel) the whole of it is the native kernel instead.
    """
    if rows.native is not None:
        native = rows.native
        return run_decode_attention(native.kernel, q, pool.k[layer], pool.v[layer], native.tables,
                                    native.context_lens, native.max_context)
    assert rows.k_pages is not None
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
