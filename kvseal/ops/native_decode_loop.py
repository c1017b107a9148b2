"""Decode-only steps of a float32 or bfloat16 model in one native call (`csrc/decode_loop.c`),
and a bfloat16 model's prefill steps.

The per-layer forward calls ~20 small kernels per layer from Python; at one to eight decode
rows that costs 4-6 ms a step, a sixth of a single-stream decode step. A step whose every row
decodes one token (the common step once prompts are in) runs all layers in one C call instead:
the same kernels, in the same order, on the same buffers, so its result is bit-equal to the
per-layer path. A float32 model's linears must be kvseal's panels of one kind
(`kvseal_decode_layers`), a bfloat16 model's tiles (`kvseal_decode_layers_bf16`). Models with
per-head q/k norms, or other linears keep the per-layer path.

A step of fresh prefill chunks (prompts from their first token, of any lengths) after the step's
decode rows or none (one prompt, a wave of prompts, or the next prompts of a wave while the
first ones decode: the steps that decide a request's time to first token) runs the same way in
a bfloat16 model whose fresh chunks the prefill attention kernel takes
(`kvseal_prefill_layers_bf16`, one attention call per group of equal lengths): ~20 Python calls
a layer are ~5 ms of a 256-token prompt's ~50 ms step. So does a step whose chunks continue a
cached prefix (the rest of a prompt the budget split, a long prompt's later chunks: one
attention call each, over its own rows and its prefix's pages, checked as the per-layer path
checks them). Decode rows after the chunks keep the per-layer path.

The KV writes are the same bounds-checked kernel (`kvseal_write_slots`, which refuses a slot
outside the pool writing nothing), and the pool records each layer the call wrote, exactly as
`KVPool.write_by` does per layer (`KVPool.write_layers_by`), so the isolation checks of the
next step see the same coverage either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from kvseal.kvcache.pool import KVPool
from kvseal.ops.interface import DecodePlan, DecoderStack, DecoderWeights, FreshPrefills, PrefillSpan
from kvseal.ops.native_kernels import NativeKernels, prefix_pages
from kvseal.ops.native_linears import Int8PanelLinear, PanelLinear, TileLinear
from kvseal.ops.native_plans import NativeRows

_NO_ROWS = torch.zeros(0, dtype=torch.int64)
_TILES = -1  # the kind of a bfloat16 model whose every linear is a TileLinear


class NativeDecodeLoop:
    """The pointer table of one model's decoder weights, and the call that runs them."""

    def __init__(self, stack: DecoderStack, kernels: NativeKernels, kind: int, fresh_prefill: bool = False) -> None:
        self.kernels, self.kind, self.stack = kernels, kind, stack
        # fresh prefill steps too: a bfloat16 tile model whose fresh chunks the kernel runs
        self.fresh_prefill = fresh_prefill and kind == _TILES
        self._gate_up_scratch = any(layer.gate_up_proj.bias is not None for layer in stack.layers) \
            or stack.inter % 16 != 0  # the fused gate/up + SiLU declines: the two passes need it
        lib, ffi = kernels.lib, kernels.ffi
        self.num_layers = len(stack.layers)
        self.q_size = stack.heads * stack.head_dim
        self.width = self.q_size + 2 * stack.kv_heads * stack.head_dim
        self.dtype = torch.bfloat16 if kind == _TILES else torch.float32
        self.per_layer = int(lib.KVSEAL_LAYER_POINTERS)
        self.table = ffi.new("const void *[]", self.num_layers * self.per_layer)
        self.step = ffi.new("struct kvseal_decode_step *")
        self.step.num_layers, self.step.hidden, self.step.inter = self.num_layers, stack.hidden, stack.inter
        self.step.heads, self.step.kv_heads, self.step.head_dim = stack.heads, stack.kv_heads, stack.head_dim
        self.step.eps, self.step.scale = stack.final_eps, stack.head_dim**-0.5
        self._bound_pool: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None
        self._scratch: tuple[torch.Tensor, ...] = ()  # the internal buffers of the last row count
        weights = (lib.KVSEAL_W_QKV, lib.KVSEAL_W_O, lib.KVSEAL_W_GATE_UP, lib.KVSEAL_W_DOWN)
        blocks = (lib.KVSEAL_Q4_QKV, lib.KVSEAL_Q4_O, lib.KVSEAL_Q4_GATE_UP, lib.KVSEAL_Q4_DOWN)
        for index, layer in enumerate(stack.layers):
            base = index * self.per_layer
            for at, q4_at, linear in zip(weights, blocks, _linears(layer)):
                assert isinstance(linear, (TileLinear, PanelLinear, Int8PanelLinear)), "for_stack checked the kinds"
                self.table[base + at] = self._pointer(linear.tiles if isinstance(linear, TileLinear) else linear.panels)
                scale = linear.scale if isinstance(linear, Int8PanelLinear) else None
                self.table[base + at + 1] = self._pointer(scale)
                self.table[base + at + 2] = self._pointer(linear.bias)
                # a one-row step multiplies by these where the linear holds them (csrc/linear_q4.c)
                self.table[base + q4_at] = self._pointer(linear.q4_1 if isinstance(linear, TileLinear) else None)
            self.table[base + lib.KVSEAL_INPUT_NORM] = self._pointer(layer.input_norm)
            self.table[base + lib.KVSEAL_POST_NORM] = self._pointer(layer.post_norm)

    @classmethod
    def for_stack(cls, stack: DecoderStack, kernels: NativeKernels,
                  fresh_prefill: bool = False) -> NativeDecodeLoop | None:
        """The loop for `stack`, or None if some part of it is not what the loop runs: norms of
        the model's dtype and one eps; in a float32 model every linear a float32 or bfloat16
        panel linear of one dtype, or every one an int8 panel linear; in a bfloat16 model every
        linear a tile linear."""
        dtype = stack.final_norm.dtype
        norms = [stack.final_norm] + [n for layer in stack.layers for n in (layer.input_norm, layer.post_norm)]
        eps = {stack.final_eps} | {e for layer in stack.layers for e in (layer.input_eps, layer.post_eps)}
        kinds = {_kind(linear, dtype, kernels.lib) for layer in stack.layers for linear in _linears(layer)}
        kind = kinds.pop() if len(kinds) == 1 else None
        if kind is None or len(eps) != 1 or any(n.dtype != dtype or not n.is_contiguous() for n in norms):
            return None
        return cls(stack, kernels, kind, fresh_prefill)

    def takes(self, plan: DecodePlan) -> bool:
        return isinstance(plan, NativeRows)

    def run(self, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, slots: torch.Tensor,
            plan: DecodePlan, pool: KVPool) -> torch.Tensor:
        assert isinstance(plan, NativeRows), "run only a plan it takes"
        rows = h.shape[0]
        tensors = (h, cos, signed_sin, slots, plan.tables, plan.context_lens)
        if any(not t.is_contiguous() for t in tensors) or h.dtype != self.dtype or slots.shape != (rows,):
            raise TypeError(f"the decode loop takes contiguous {self.dtype} rows and one int64 slot per row")
        lib = self.kernels.lib
        self._bind(pool)
        step = self.step
        step.rows, step.num_pages, step.page_size = rows, pool.num_pages, pool.page_size
        step.table_width, step.max_context = plan.tables.shape[1], plan.max_context
        step.threads = torch.get_num_threads()
        x = torch.empty_like(h)  # returned: never one of the reused buffers
        tmp, qkv, q, attn, gate_up, act = self._buffers(rows)
        ptr = self.kernels.ptr
        positions = [ptr(t) for t in (cos, signed_sin, slots, plan.tables, plan.context_lens)]
        final_norm = ptr(self.stack.final_norm)
        if self.kind == _TILES:  # q is read in place from the qkv rows
            self._store_layers(slots, pool, lambda written: lib.kvseal_decode_layers_bf16(
                step, self.table, final_norm, *(ptr(t) for t in (h, x, qkv, attn, tmp, gate_up, act)), *positions,
                written))
        else:
            self._store_layers(slots, pool, lambda written: lib.kvseal_decode_layers(
                self.kind, step, self.table, final_norm, *(ptr(t) for t in (h, x, qkv, q, attn, tmp, gate_up, act)),
                *positions, written))
        return x

    def takes_fresh(self, groups: Sequence[FreshPrefills], spans: Sequence[PrefillSpan],
                    decode: DecodePlan | None) -> bool:
        if decode is not None and not isinstance(decode, NativeRows):  # another backend's decode plan
            return False
        return self.fresh_prefill and (len(groups) > 0 or len(spans) > 0)

    def run_fresh(self, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, slots: torch.Tensor,
                  groups: Sequence[FreshPrefills], spans: Sequence[PrefillSpan], decode: DecodePlan | None,
                  sampled: torch.Tensor, pool: KVPool) -> torch.Tensor:
        rows = h.shape[0]
        decodes = decode.context_lens.numel() if isinstance(decode, NativeRows) else 0
        starts = groups[0].starts if len(groups) == 1 else torch.cat([g.starts for g in groups] or [_NO_ROWS])
        sizes = torch.tensor([[g.starts.numel(), g.length] for g in groups], dtype=torch.int64).reshape(-1, 2)
        span_rows, span_pages = self._span_arguments(spans, pool, decodes, rows)
        tensors = (h, cos, signed_sin, slots, starts, sampled)
        covered = decodes + int((sizes[:, 0] * sizes[:, 1]).sum()) + sum(span.token_end - span.token_start
                                                                          for span in spans)
        if not self.takes_fresh(groups, spans, decode) or any(not t.is_contiguous() for t in tensors) \
                or h.dtype != self.dtype or slots.shape != (rows,) or starts.dtype != torch.int64 or covered != rows:
            raise TypeError("the prefill loop takes contiguous bfloat16 rows, one int64 slot per row, the decode "
                            "rows first and prefill chunks over every other row")
        # the kernels index rows by these: each must be a row of this step, and no chunk a decode row
        if sampled.dtype != torch.int64 or sampled.dim() != 1 \
                or (sampled.numel() and (int(sampled.min()) < 0 or int(sampled.max()) >= rows)) \
                or any(int(g.starts.min()) < decodes or int(g.starts.max()) + g.length > rows for g in groups):
            raise IndexError("a sampled row or a chunk lies outside the step's rows")
        lib = self.kernels.lib
        self._bind(pool)
        step = self.step
        step.rows, step.num_pages, step.page_size = rows, pool.num_pages, pool.page_size
        tables = context_lens = None
        step.table_width, step.max_context = 0, 0
        if isinstance(decode, NativeRows) and decodes:
            tables, context_lens = decode.tables, decode.context_lens
            if not (tables.is_contiguous() and context_lens.is_contiguous()):
                raise TypeError("the prefill loop reads the decode rows' tables and context lengths in place")
            step.table_width, step.max_context = tables.shape[1], decode.max_context
        step.threads = torch.get_num_threads()
        stack, n = self.stack, sampled.numel()
        x = torch.empty_like(h)
        qkv, attn = torch.empty((rows, self.width), dtype=h.dtype), torch.empty((rows, self.q_size), dtype=h.dtype)
        tmp, act = torch.empty_like(h), torch.empty((rows, stack.inter), dtype=h.dtype)
        gate_up = torch.empty((rows, 2 * stack.inter) if self._gate_up_scratch else (1,), dtype=h.dtype)
        hs, xs = torch.empty((n, stack.hidden), dtype=h.dtype), torch.empty((n, stack.hidden), dtype=h.dtype)
        ptr = self.kernels.ptr
        self._store_layers(slots, pool, lambda written: lib.kvseal_prefill_layers_bf16(
            step, self.table, ptr(stack.final_norm), *(ptr(t) for t in (h, x, qkv, attn, tmp, gate_up, act, cos,
                                                                            signed_sin, slots)),
            decodes, ptr(tables), ptr(context_lens), ptr(starts), ptr(sizes), len(groups), ptr(span_rows), len(spans),
            ptr(span_pages), ptr(sampled), n, ptr(hs), ptr(xs), written))
        return xs

    @staticmethod
    def _span_arguments(spans: Sequence[PrefillSpan], pool: KVPool, decodes: int,
                        rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's spans ([len(spans), 4] int64: first row, rows, prefix slots, offset of the
        span's pages) and their pages, one after another. Checked as the per-layer prefix
        attention checks them: each span's rows are rows of this step after the decode rows,
        and each page its prefix reads is a page of the pool (the kernel reads those slots)."""
        entries, pages, offset = [], [], 0
        for span in spans:
            prefix = span.context_len - (span.token_end - span.token_start)
            if span.token_start < decodes or span.token_end > rows or span.token_end <= span.token_start \
                    or prefix <= 0:
                raise IndexError("a chunk lies outside the step's rows")
            used = prefix_pages(span.pages, prefix, pool.page_size, pool.num_pages)
            entries.append((span.token_start, span.token_end - span.token_start, prefix, offset))
            pages.append(used)
            offset += used.numel()
        return (torch.tensor(entries, dtype=torch.int64).reshape(-1, 4),
                torch.cat(pages).contiguous() if pages else _NO_ROWS)

    def _store_layers(self, slots: torch.Tensor, pool: KVPool, call: Callable[[Any], int]) -> None:
        """Run a loop kernel (`call(written)`: its status; it counts the layers whose K/V it
        stored into *written) as the pool's recorded write of `slots`; IndexError for a slot
        outside the pool (nothing written in that layer), MemoryError if a kernel could not
        allocate its scratch."""
        written = self.kernels.ffi.new("int64_t *")
        status = 0

        def store() -> int:
            nonlocal status
            status = call(written)
            return int(written[0])

        pool.write_layers_by(slots, store)
        if status == -1:
            raise IndexError("a KV slot is outside the pool layer")
        if status != 0:
            raise MemoryError("a loop kernel could not allocate its scratch")

    def _bind(self, pool: KVPool) -> None:
        """The pool's K and V tensors into the pointer table, once per pool (its tensors never
        change: `KVPool.k` and `.v` are tuples)."""
        if self._bound_pool is not None and self._bound_pool[0] is pool.k and self._bound_pool[1] is pool.v:
            return
        lib = self.kernels.lib
        if len(pool.k) != self.num_layers:
            raise TypeError(f"the decode loop runs {self.num_layers} layers, the pool has {len(pool.k)}")
        for layer, (k, v) in enumerate(zip(pool.k, pool.v)):
            if k.dtype != self.dtype or v.dtype != self.dtype or not (k.is_contiguous() and v.is_contiguous()):
                raise TypeError(f"the decode loop reads a contiguous {self.dtype} pool")
            self.table[layer * self.per_layer + lib.KVSEAL_K_POOL] = self._pointer(k)
            self.table[layer * self.per_layer + lib.KVSEAL_V_POOL] = self._pointer(v)
        self._bound_pool = pool.k, pool.v  # held: the table's addresses stay valid

    def _buffers(self, rows: int) -> tuple[torch.Tensor, ...]:
        """The loop's internal buffers for `rows` rows (tmp, qkv, q, attn, gate_up, act), reused
        while the row count stays: nothing outside the call ever sees them."""
        if not self._scratch or self._scratch[0].shape[0] != rows:
            hidden, inter, dtype = self.stack.hidden, self.stack.inter, self.dtype
            self._scratch = tuple(torch.empty((rows, width), dtype=dtype) for width in (
                hidden, self.width, self.q_size, self.q_size, 2 * inter, inter))
        return self._scratch

    def _pointer(self, tensor: torch.Tensor | None) -> Any:
        ffi = self.kernels.ffi
        return ffi.NULL if tensor is None else ffi.cast("void *", tensor.data_ptr())


def _kind(linear: nn.Module, dtype: torch.dtype, lib: Any) -> int | None:
    """The loop's kind for one linear of a model of `dtype` (the header's enum
    kvseal_panel_kind, or _TILES); None where the loop cannot run it."""
    if dtype == torch.bfloat16:
        return _TILES if isinstance(linear, TileLinear) else None
    if dtype != torch.float32:
        return None
    if isinstance(linear, Int8PanelLinear):
        return int(lib.KVSEAL_PANELS_I8)
    if isinstance(linear, PanelLinear):
        return int(lib.KVSEAL_PANELS_F32 if linear.panels.dtype == torch.float32 else lib.KVSEAL_PANELS_BF16)
    return None


def _linears(layer: DecoderWeights) -> tuple[nn.Module, ...]:
    return layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj
