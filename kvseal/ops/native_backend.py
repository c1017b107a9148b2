"""`NativeOps`: kvseal's C kernels (built for this CPU at first start), and `TorchOps` wherever a
kernel does not apply: a dtype other than float32 and bfloat16, a head size a kernel does not
take, rows that are not the fused qkv projection's, a linear the packings cannot hold.

Where each kernel runs, and what it reads, is at the top of its file in `csrc/`. The choices
made here, per call:

- Decode attention: the kernel for float32 and bfloat16 pools (K and V read in place through
  each row's own table, slots 0..context_len-1 only).
- Fresh prefill chunks: the prefill kernel over the fused qkv rows in place (each chunk's own
  rows, never the pool). A bfloat16 forward runs the bfloat16 kernel where the build has
  AVX512-BF16, else the float32 kernel on rows widened once per layer (exact), each output
  rounded once. On CPUs whose AMX runs the tile linears, torch's SDPA (flash attention on AMX
  through oneDNN) is the faster for head dims the AMX kernel skips (not a multiple of 64: 101
  against 140 ms for a 2,048-token step's 30 layers, docs/benchmarks-archive.md round 20), so those go
  to SDPA; for multiples of 64 the kernel runs on AMX tiles itself (60 against 92 ms, round 22).
- A chunk after a cached prefix: the same kernel, reading the chunk's own rows and its
  sequence's own pool slots 0..prefix-1 through its pages.
- Linears: float32 weights as panels (`PanelLinear`; bfloat16-stored for `--quantization bf16`;
  `Int8PanelLinear` for int8), bfloat16 weights as tiles where the build runs them and the input
  width is a multiple of 32 (`TileLinear`); otherwise torch's (oneDNN, int8pack).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kvseal.kvcache.pool import KVPool
from kvseal.kvcache.records import RecordKernels
from kvseal.ops.interface import DecodeLoop, DecodePlan, DecoderStack, FreshPrefills, NewTokens, PrefillSpan
from kvseal.ops.native_decode_loop import NativeDecodeLoop
from kvseal.ops.native_kernels import TILE_K_MULTIPLE, CachedPrefix, NativeKernels, takes_kv_rows
from kvseal.ops.native_linears import Int8PanelLinear, PanelLinear, SumTileLinear, TileLinear
from kvseal.ops.native_plans import NativeRows
from kvseal.ops.native_records import NativeRecordKernels
from kvseal.ops.torch_backend import TorchOps
from kvseal.ops.torch_linears import SumCopyLinear

_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


class NativeOps:
    """The C kernels where they apply, `fallback` (torch) elsewhere."""

    name = "native"

    def __init__(self, kernels: NativeKernels, fallback: TorchOps | None = None) -> None:
        self.kernels = kernels
        self.fallback = fallback or TorchOps()

    # ---- attention

    def plan_decode(self, tables: torch.Tensor, context_lens: list[int], pool: KVPool,
                    num_heads: int) -> DecodePlan:
        if pool.k[0].dtype not in _NATIVE_DTYPES:
            return self.fallback.plan_decode(tables, context_lens, pool, num_heads)
        return NativeRows(tables, torch.tensor(context_lens, dtype=torch.int64), max(context_lens))

    def decode_attention(self, q: torch.Tensor, pool: KVPool, layer: int, plan: DecodePlan) -> torch.Tensor:
        if not isinstance(plan, NativeRows):
            return self.fallback.decode_attention(q, pool, layer, plan)
        return self.kernels.decode_attention(q, pool.k[layer], pool.v[layer], plan.tables, plan.context_lens,
                                             plan.max_context)

    def fresh_attention(self, tokens: NewTokens, groups: Sequence[FreshPrefills], out: torch.Tensor) -> None:
        kernel_dtype = self.fresh_kernel_dtype(tokens)
        if kernel_dtype is None:
            return self.fallback.fresh_attention(tokens, groups, out)
        assert tokens.qkv is not None
        q, kv_heads = tokens.q, tokens.k.shape[1]
        fused, fused_out = tokens.qkv, out
        if fused.dtype != kernel_dtype:  # a bfloat16 forward without its kernel: widened once a layer
            fused, fused_out = fused.float(), torch.empty(out.shape, dtype=torch.float32)
        for group in groups:
            # Isolation: the kernel reads each chunk's own rows of qkv only (the tokens of this
            # forward of that same sequence, positions 0..length-1), never the pool.
            self.kernels.prefill_attention(fused, group.starts, group.length, q.shape[1], kv_heads, q.shape[2],
                                           fused_out)
            if fused_out is not out:  # the group's rows, rounded once
                picked = group.rows()
                out[picked] = fused_out[picked].to(out.dtype)

    def fresh_kernel_dtype(self, tokens: NewTokens) -> torch.dtype | None:
        """The rows' dtype the prefill kernel runs fresh chunks in (bfloat16 rows: bfloat16, or
        float32 on rows widened where the build has no bfloat16 kernel); None: SDPA runs them."""
        if tokens.qkv is None or not fused_rows(tokens):
            return None
        dtype = tokens.qkv.dtype
        if self.sdpa_leads_fresh_prefill(dtype, tokens.q.shape[2]):
            return None
        if self.kernels.has_prefill_attention(dtype):
            return dtype
        return torch.float32 if dtype == torch.bfloat16 else None

    def sdpa_leads_fresh_prefill(self, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether a fresh prefill of `dtype` is faster in torch's SDPA than in the kernel:
        bfloat16 where AMX runs the tile linears and the head dim is not a multiple of 64 (see
        the module docstring). Without AMX the kernel takes under half of SDPA's time (round 11)."""
        amx = dtype == torch.bfloat16 and self.kernels.tile_engine == self.kernels.TILES_AMX
        return amx and head_dim % 64 != 0

    def prefix_attention(self, tokens: NewTokens, span: PrefillSpan, pool: KVPool, layer: int,
                         out: torch.Tensor) -> None:
        k_pool, v_pool = pool.k[layer], pool.v[layer]
        if tokens.qkv is None or tokens.qkv.dtype != k_pool.dtype or not self.kernels.has_prefill_attention(
                k_pool.dtype) or not fused_rows(tokens):
            return self.fallback.prefix_attention(tokens, span, pool, layer, out)
        # Isolation: the kernel reads this chunk's own rows of qkv and its sequence's own pool
        # slots 0..prefix-1 (through span.pages), nothing else.
        cached = CachedPrefix(span.context_len - span.query_len, span.pages, k_pool, v_pool)
        q = tokens.q
        self.kernels.prefill_attention(tokens.qkv, span.starts, span.query_len, q.shape[1], tokens.k.shape[1],
                                       q.shape[2], out, cached)

    # ---- linears

    def linear(self, linear: nn.Linear, weight_dtype: torch.dtype) -> nn.Module:
        dtype = linear.weight.dtype
        if dtype == torch.float32:
            return PanelLinear(linear, self.kernels, weight_dtype)
        if dtype == weight_dtype == torch.bfloat16 and self.kernels.tile_engine != self.kernels.TILES_NONE \
                and linear.in_features % TILE_K_MULTIPLE == 0:
            return TileLinear(linear, self.kernels)
        return self.fallback.linear(linear, weight_dtype)

    def takes_gguf_blocks(self) -> bool:
        """Where the row kernels run: the tiles on AVX512-BF16 dot products. Not on AMX, where their
        sums would not be the AMX tiles' bits (csrc/linear_q4.c), nor without AVX512-BF16."""
        return self.kernels.tile_engine == self.kernels.TILES_AVX512

    def hold_q4_1(self, linear: nn.Module, blocks: torch.Tensor) -> bool:
        """A tile linear takes the blocks for its one-row steps (`TileLinear.hold_q4_1`) where
        `takes_gguf_blocks`."""
        if not isinstance(linear, TileLinear) or not self.takes_gguf_blocks():
            return False
        linear.hold_q4_1(blocks)
        return True

    def hold_q8_0(self, linear: nn.Module, blocks: torch.Tensor) -> bool:
        """As `hold_q4_1` (`TileLinear.hold_q8_0`)."""
        if not isinstance(linear, TileLinear) or not self.takes_gguf_blocks():
            return False
        linear.hold_q8_0(blocks)
        return True

    def partial_sum_linear(self, linear: nn.Linear) -> nn.Module:
        """The tiles' float32 sums where the tile linears run (one copy of the weight); else a
        float32 copy over the panels."""
        if linear.weight.dtype == torch.bfloat16 and self.kernels.tile_engine != self.kernels.TILES_NONE \
                and linear.in_features % TILE_K_MULTIPLE == 0:
            return SumTileLinear(linear, self.kernels)
        return SumCopyLinear(linear, lambda wide: self.linear(wide, torch.float32))

    def int8_linear(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    model_dtype: torch.dtype) -> nn.Module:
        if model_dtype == torch.float32:
            return Int8PanelLinear(qweight, scale, bias, self.kernels)
        return self.fallback.int8_linear(qweight, scale, bias, model_dtype)

    def gate_up_silu(self, x: torch.Tensor, gate_up: nn.Module, inter: int) -> torch.Tensor:
        if x.dtype not in _NATIVE_DTYPES:
            return self.fallback.gate_up_silu(x, gate_up, inter)
        if isinstance(gate_up, TileLinear) and gate_up.q4_1 is not None and gate_up.bias is None \
                and x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous():  # one row over the Q4_1 blocks
            act = self.kernels.linear_silu_q4_1_row(x, gate_up.q4_1, inter)
            if act is not None:
                return act
        if isinstance(gate_up, (PanelLinear, TileLinear)):  # gate/up and SiLU in one pass where it applies
            packed = gate_up.panels if isinstance(gate_up, PanelLinear) else gate_up.tiles
            act = self.kernels.linear_silu(x, packed, gate_up.bias, inter)
            if act is not None:
                return act
        return self.kernels.silu_mul(gate_up(x).contiguous())

    # ---- fused per-layer ops

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor) -> torch.Tensor:
        if h.dtype not in _NATIVE_DTYPES:
            return self.fallback.add_rms_norm(h, delta, weight, eps, out)
        self.kernels.add_rms_norm(h, None if delta is None else delta.contiguous(), weight, eps, out)
        return out

    def rope_(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int,
              head_dim: int) -> None:
        if qkv.dtype not in _NATIVE_DTYPES:
            return self.fallback.rope_(qkv, cos, signed_sin, heads, head_dim)
        self.kernels.rope_(qkv, cos, signed_sin, heads, head_dim)

    def write_kv(self, pool: KVPool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        k_pool, v_pool = pool.k[layer], pool.v[layer]
        if k_pool.dtype not in _NATIVE_DTYPES or not takes_kv_rows(k, v, k_pool, v_pool):
            return self.fallback.write_kv(pool, layer, slots, k, v)
        pool.write_by(layer, slots, lambda k_layer, v_layer: self.kernels.write_slots(k, v, slots, k_layer, v_layer))

    def decode_loop(self, stack: DecoderStack) -> DecodeLoop | None:
        if stack.final_norm.dtype not in _NATIVE_DTYPES:
            return None
        bf16 = torch.bfloat16
        fresh = self.kernels.has_prefill_attention(bf16) and not self.sdpa_leads_fresh_prefill(bf16, stack.head_dim)
        return NativeDecodeLoop.for_stack(stack, self.kernels, fresh_prefill=fresh)

    # ---- the sampler

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The kernel: the same answer as torch's, ~11x faster on a 32-row step's [32, 49,152]
        float32 logits; bfloat16 rows are read as they are."""
        if x.dtype not in _NATIVE_DTYPES or not x.is_contiguous() or x.dim() != 2 or x.shape[-1] == 0:
            return self.fallback.argmax_rows(x)
        return self.kernels.argmax_rows(x)

    def draw_rows(self, x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  u: torch.Tensor) -> torch.Tensor:
        """The kernel (`csrc/sample.c`) over the logits as they are (bfloat16 read in place): on a
        32-row step's [32, 49,152] logits 0.45 against 4.6 ms at temperature 1, ~5 against ~55 ms
        with top_p 0.95 (no sort). A row with a NaN or no token of weight takes the torch path,
        as torch answers it."""
        if x.dtype in _NATIVE_DTYPES and x.is_contiguous() and x.dim() == 2 and x.shape[-1] > 0:
            drawn = self.kernels.draw_rows(x, temperature, top_p, u)
            if drawn is not None:
                return drawn
        return self.fallback.draw_rows(x, temperature, top_p, u)

    # ---- the isolation records

    def record_kernels(self) -> RecordKernels | None:
        """One C call for the always-on check and one for the records' growth a step
        (`csrc/records.c`) instead of about twenty torch ops."""
        return NativeRecordKernels(self.kernels)


def fused_rows(tokens: NewTokens) -> bool:
    """Whether the prefill kernel takes these rows: float32 or bfloat16, head_dim a multiple of
    8, and q, k, v the q / K / V column blocks of the qkv rows."""
    q, k, v, qkv = tokens.q, tokens.k, tokens.v, tokens.qkv
    assert qkv is not None
    heads, kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    if qkv.dtype not in _NATIVE_DTYPES or k.dtype != qkv.dtype or not qkv.is_contiguous() or head_dim % 8:
        return False
    base, size = qkv.data_ptr(), qkv.element_size()
    assert qkv.shape[1] == (heads + 2 * kv_heads) * head_dim and q.data_ptr() == base \
        and k.data_ptr() == base + size * heads * head_dim \
        and v.data_ptr() == base + size * (heads + kv_heads) * head_dim, "q, k, v are the column blocks of the qkv rows"
    return True
