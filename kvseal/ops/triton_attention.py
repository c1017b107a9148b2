"""Attention over the paged KV pool as Triton kernels: decode rows and prefill chunks.

The CUDA backend's attention. The same kernels run on CPU tensors under Triton's interpreter
(`TRITON_INTERPRET=1`, read by Triton when this module is imported), which is how CI tests them
on machines without a GPU.

**What a kernel reads (I4).** A row (decode) or a chunk (prefill) reads, of the pool, only the
slots 0..context_len-1 of its own block table: a key index n < context_len is turned into
(page table[n // page_size], offset n % page_size), and every load of a key or value at an
index >= context_len (or past the causal position of the query) is masked, so it is never
issued. A table may be padded past its row's pages with anything: no index past context_len
looks it up. Fresh chunks read no pool at all, only this forward's own k and v rows. The
kernel tests fill every other slot of the pool with NaN: one read of a foreign or unwritten
slot would make the output NaN.

Layout: the pool's per-layer K and V are [num_kv_heads, num_pages, page_size, head_dim]
(`kvcache/pool.py`); q [T, H, D] (decode: [B, H, D]); query head h reads KV head
h // (H / num_kv_heads). Scores and the softmax are float32; P is rounded to V's dtype for the
P·V product (as flash attention does); the output has q's dtype.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

MIN_DOT = 16  # tl.dot's smallest block side
# Under the interpreter, tl.dot of bfloat16 blocks is wrong (Triton 3.9: numpy has no bfloat16;
# off by orders of magnitude), so the operands are widened to float32 first there. A bfloat16
# product is exact in float32 and the GPU's MMA sums in float32 too: the same arithmetic.
WIDEN_DOTS = bool(triton.knobs.runtime.interpret)


def _block(n: int, floor: int = MIN_DOT) -> int:
    return max(floor, triton.next_power_of_2(n))


@triton.jit
def _dot(a, b, WIDEN: tl.constexpr):
    if WIDEN:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _attend_block(s, v, m_i, l_i, acc, WIDEN: tl.constexpr):
    """One key block of the online softmax: s [M, N] masked scores (-inf where not visible),
    v [N, D]; returns the running max, sum and weighted values. A row that has seen no visible
    key yet keeps max -inf, sum 0 and values 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, WIDEN)
    return m_new, l_i, acc


@triton.jit
def _key_block_addresses(tables_ptr, row, offs_n, mask_n, kvh, stride_tr, stride_tp,
                         stride_kh, stride_kp, stride_ks, PAGE: tl.constexpr):
    """Element offsets (without the feature offset) of keys offs_n of `row` in a pool layer."""
    pages = tl.load(tables_ptr + row * stride_tr + (offs_n // PAGE) * stride_tp, mask=mask_n, other=0)
    return kvh * stride_kh + pages.to(tl.int64) * stride_kp + (offs_n % PAGE) * stride_ks


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, ctx_ptr, out_ptr,
                   stride_qb, stride_qh, stride_kh, stride_kp, stride_ks, stride_tr, stride_tp,
                   stride_ob, stride_oh, scale,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, WIDEN: tl.constexpr):
    # One program: decode row b, KV head kvh, its GROUP query heads at once.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g
    # q: [BLOCK_G, BLOCK_D]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(0, ctx, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < ctx
        at = _key_block_addresses(tables_ptr, b, offs_n, mask_n, kvh, stride_tr, stride_tp,
                                  stride_kh, stride_kp, stride_ks, PAGE)
        kv_mask = mask_n[:, None] & mask_d[None, :]
        # k, v: [BLOCK_N, BLOCK_D]; masked keys are never loaded
        k = tl.load(k_ptr + at[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), WIDEN) * scale  # [BLOCK_G, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        v = tl.load(v_ptr + at[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend_block(s, v, m_i, l_i, acc, WIDEN)
    out = acc / l_i[:, None]  # every row sees slot 0 at least
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_g[:, None] & mask_d[None, :])


def paged_decode_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                           context_lens: torch.Tensor) -> torch.Tensor:
    """q [B, H, D] -> [B, H, D]: each row's query over its own slots 0..context_lens[b]-1 through
    tables [B, max_pages] (int32/int64); k_pool, v_pool: one layer [KV, num_pages, page_size, D]."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pool.shape
    _check_pool(q, k_pool, v_pool, num_heads)
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    group = num_heads // num_kv_heads
    block_n = max(MIN_DOT, min(64, triton.next_power_of_2(page_size) * 4))
    _decode_kernel[(batch, num_kv_heads)](
        q, k_pool, v_pool, tables, context_lens, out,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        tables.stride(0), tables.stride(1), out.stride(0), out.stride(1), 1.0 / math.sqrt(head_dim),
        GROUP=group, HEAD_DIM=head_dim, PAGE=page_size,
        BLOCK_G=_block(group), BLOCK_D=_block(head_dim), BLOCK_N=block_n, WIDEN=WIDEN_DOTS)
    return out


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, tables_ptr, q_start_ptr, q_len_ptr, ctx_ptr, out_ptr,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_kp, stride_ks, stride_vt, stride_vh,
                    stride_tr, stride_tp, stride_ot, stride_oh, scale,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, PAGED: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                    WIDEN: tl.constexpr):
    # One program: BLOCK_M query tokens of chunk c, one query head h.
    c = tl.program_id(0)
    m_block = tl.program_id(1)
    h = tl.program_id(2)
    q_len = tl.load(q_len_ptr + c)
    if m_block * BLOCK_M >= q_len:
        return
    ctx = tl.load(ctx_ptr + c)
    q_start = tl.load(q_start_ptr + c)
    kvh = h // GROUP
    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    pos_m = ctx - q_len + offs_m  # each query's position: it sees keys 0..pos
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    key_end = tl.minimum(ctx, ctx - q_len + (m_block + 1) * BLOCK_M)  # past the block's last query: masked
    for start in range(0, key_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < key_end
        if PAGED:  # K and V pools share one layout
            k_at = _key_block_addresses(tables_ptr, c, offs_n, mask_n, kvh, stride_tr, stride_tp,
                                        stride_kh, stride_kp, stride_ks, PAGE)
            v_at = k_at
        else:  # a fresh chunk: its keys are its own rows of this forward's k, v [T, KV, D]
            rows_n = (q_start + offs_n).to(tl.int64)
            k_at = rows_n * stride_kt + kvh * stride_kh
            v_at = rows_n * stride_vt + kvh * stride_vh
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + k_at[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        s = _dot(q, tl.trans(k), WIDEN) * scale  # [BLOCK_M, BLOCK_N]
        visible = mask_n[None, :] & (offs_n[None, :] <= pos_m[:, None])
        s = tl.where(visible, s, float("-inf"))
        v = tl.load(v_ptr + v_at[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend_block(s, v, m_i, l_i, acc, WIDEN)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # padded query rows (not stored) saw nothing
    tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def paged_prefill_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, tables: torch.Tensor,
                            q_starts: torch.Tensor, q_lens: torch.Tensor, context_lens: torch.Tensor,
                            out: torch.Tensor, max_q_len: int) -> None:
    """Causal attention of prefill chunks over their sequences' slots, written into out [T, H, D].

    Chunk c is q rows q_starts[c] .. q_starts[c] + q_lens[c] - 1, at positions
    context_lens[c] - q_lens[c] .. context_lens[c] - 1 of its sequence; query i sees the
    sequence's keys 0..its position, read through tables[c] (its own pages: the cached prefix,
    then the chunk's own tokens, already written to the pool). No other row of out is written."""
    num_heads, head_dim = q.shape[1:]
    _check_pool(q, k_pool, v_pool, num_heads)
    _launch_prefill(q, k_pool, v_pool, tables, q_starts, q_lens, context_lens, out, max_q_len, paged=True)


def fresh_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_starts: torch.Tensor,
                            q_lens: torch.Tensor, out: torch.Tensor, max_q_len: int) -> None:
    """Causal attention of chunks that start at position 0, each over its own rows of this
    forward's k, v [T, KV, D] (no pool): chunk c is rows q_starts[c] .. + q_lens[c] - 1."""
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("fresh_prefill_attention needs q, k and v with contiguous features")
    _launch_prefill(q, k, v, q_starts, q_starts, q_lens, q_lens, out, max_q_len, paged=False)


def _launch_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, q_starts: torch.Tensor,
                    q_lens: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor, max_q_len: int,
                    paged: bool) -> None:
    num_chunks = q_lens.shape[0]
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k.shape[0] if paged else k.shape[1]
    if num_chunks == 0 or max_q_len == 0:
        return
    block_m = 16 if max_q_len <= 16 else 32
    strides = ((0, k.stride(0), k.stride(1), k.stride(2), 0, 0, tables.stride(0), tables.stride(1)) if paged
               else (k.stride(0), k.stride(1), 0, 0, v.stride(0), v.stride(1), 0, 0))
    page_size = k.shape[2] if paged else 1
    grid = (num_chunks, triton.cdiv(max_q_len, block_m), num_heads)
    _prefill_kernel[grid](
        q, k, v, tables, q_starts, q_lens, context_lens, out,
        q.stride(0), q.stride(1), *strides, out.stride(0), out.stride(1), 1.0 / math.sqrt(head_dim),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE=page_size, PAGED=paged,
        BLOCK_M=block_m, BLOCK_D=_block(head_dim), BLOCK_N=32, WIDEN=WIDEN_DOTS)


def _check_pool(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, num_heads: int) -> None:
    if k_pool.shape != v_pool.shape or k_pool.stride() != v_pool.stride():
        raise ValueError(f"K and V pools differ: {tuple(k_pool.shape)} against {tuple(v_pool.shape)}")
    if k_pool.stride(-1) != 1 or q.shape[-1] != k_pool.shape[-1]:
        raise ValueError(f"head_dim {q.shape[-1]} against the pool's {k_pool.shape[-1]} (contiguous features needed)")
    if num_heads % k_pool.shape[0]:
        raise ValueError(f"{num_heads} query heads are not a multiple of {k_pool.shape[0]} KV heads")
