"""Decode-only steps of a float32 or bfloat16 model in one native call (`csrc.DECODE_LOOP`).

The native forward (`CausalLM._forward_native`) calls ~20 small kernels per layer from
Python; at one to eight decode rows that costs 4-6 ms a step, a sixth of a single-stream
decode step. A step whose every row decodes one token (the common step once prompts are in)
runs all layers in one C call instead: the same kernels, in the same order, on the same
buffers, so its result is bit-equal to the per-layer path. A float32 model's linears must be
kvseal's panels (`kvseal_decode_layers`), a bfloat16 model's tiles (AMX or AVX512-BF16)
(`kvseal_decode_layers_bf16`). Steps with prefill chunks, models with per-head q/k norms, or
other linears keep the per-layer path.

The KV writes are the same bounds-checked kernel (`kvseal_write_slots`, which refuses a slot
outside the pool writing nothing), and the pool records each layer the call wrote, exactly as
`KVPool.write_by` does per layer (`KVPool.write_layers_by`), so the isolation checks of the
next step see the same coverage either way.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from kvseal.kvcache.pool import KVPool
from kvseal.models.attention import AttentionPlan
from kvseal.models.native import NativeLibrary

if TYPE_CHECKING:
    from kvseal.models.llama import CausalLM, DecoderLayer

# Pointers per layer, in csrc.DECODE_LOOP's order: (weight, scale, bias) for qkv, o, gate_up
# and down, the two norms' weights, the layer's K and V pool.
_INPUT_NORM, _POST_NORM, _K_POOL, _V_POOL, _LAYER_POINTERS = 12, 13, 14, 15, 16
# The panels' dtype -> the kernel kind: float32 and bfloat16 panels (`packed.PanelLinear`), int8
# panels with per-channel scales (`quant.Int8Linear` with the C kernel). A linear without
# `panels` (oneDNN-packed, torch's int8pack) is not one the float32 loop can run.
_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}
_TILES = -1  # the kind of a bfloat16 model whose every linear is `packed.TileLinear` (its `tiles`)


class DecodeLoop:
    """The pointer table of one model's decoder weights, and the call that runs them."""

    def __init__(self, model: CausalLM, library: NativeLibrary, kind: int) -> None:
        cfg = model.config
        self.library, self.kind = library, kind
        self.num_layers, self.hidden, self.inter = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.heads * self.head_dim
        self.width = self.q_size + 2 * self.kv_heads * self.head_dim
        self.eps = model.model.norm.eps
        self.final_norm = model.model.norm.weight
        self.table = (ctypes.c_void_p * (self.num_layers * _LAYER_POINTERS))()
        self.dtype = torch.bfloat16 if kind == _TILES else torch.float32
        weights = "tiles" if kind == _TILES else "panels"
        for index, layer in enumerate(_layers(model)):
            base = index * _LAYER_POINTERS
            for i, linear in enumerate(_linears(layer)):
                for j, name in enumerate((weights, "scale", "bias")):  # only int8 linears have a scale
                    tensor = getattr(linear, name, None)
                    self.table[base + 3 * i + j] = None if tensor is None else tensor.data_ptr()
            self.table[base + _INPUT_NORM] = layer.input_layernorm.weight.data_ptr()
            self.table[base + _POST_NORM] = layer.post_attention_layernorm.weight.data_ptr()

    @classmethod
    def for_model(cls, model: CausalLM, library: NativeLibrary) -> DecodeLoop | None:
        """The loop for `model`, or None if some part of it is not what the loop runs: norms of
        the model's dtype and one eps, no per-head q/k norms, and in a float32 model every
        linear a float32 or bfloat16 panel linear of one dtype, or every one an int8 panel
        linear; in a bfloat16 model every linear a tile linear."""
        kinds = set()
        norms = [model.model.norm]
        dtype = model.model.norm.weight.dtype
        for layer in _layers(model):
            if layer.self_attn.has_qk_norm:
                return None
            for linear in _linears(layer):
                kinds.add(_kind(linear, dtype))
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
        kind = kinds.pop() if len(kinds) == 1 else None
        if kind is None or len({n.eps for n in norms}) != 1 or any(
                n.weight.dtype != dtype or not n.weight.is_contiguous() for n in norms):
            return None
        return cls(model, library, kind)

    @staticmethod
    def applies(plan: AttentionPlan) -> bool:
        """True for a step whose every row decodes one token with the native attention kernel."""
        decode = plan.decode
        return (decode is not None and decode.token_idx is None and decode.native is not None
                and not plan.prefills and not plan.fresh)

    def run(self, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, slots: torch.Tensor,
            plan: AttentionPlan, pool: KVPool) -> torch.Tensor:
        """h [rows, hidden]: the embedded tokens, updated in place into the residual stream;
        cos, signed_sin [rows, head_dim]; slots [rows]: where each row's K/V goes. Returns the
        final-normed stream [rows, hidden] (the lm_head's input)."""
        assert plan.decode is not None and plan.decode.native is not None, "run only where applies(plan)"
        rows_plan = plan.decode.native
        rows = h.shape[0]
        tensors = (h, cos, signed_sin, slots, rows_plan.tables, rows_plan.context_lens)
        if any(not t.is_contiguous() for t in tensors) or h.dtype != self.dtype or slots.shape != (rows,):
            raise TypeError(f"the decode loop takes contiguous {self.dtype} rows and one int64 slot per row")
        for layer in range(self.num_layers):
            if pool.k[layer].dtype != self.dtype or not pool.k[layer].is_contiguous():
                raise TypeError(f"the decode loop reads a contiguous {self.dtype} pool")
            self.table[layer * _LAYER_POINTERS + _K_POOL] = pool.k[layer].data_ptr()
            self.table[layer * _LAYER_POINTERS + _V_POOL] = pool.v[layer].data_ptr()
        x, tmp = torch.empty_like(h), torch.empty_like(h)
        qkv = torch.empty((rows, self.width), dtype=self.dtype)
        q, attn = (torch.empty((rows, self.q_size), dtype=self.dtype) for _ in range(2))
        gate_up = torch.empty((rows, 2 * self.inter), dtype=self.dtype)
        act = torch.empty((rows, self.inter), dtype=self.dtype)
        written = ctypes.c_int64(0)
        status = 0
        sizes = (rows, self.hidden, self.heads, self.kv_heads, self.head_dim, self.inter, pool.num_pages,
                 pool.page_size, rows_plan.tables.shape[1], rows_plan.max_context, self.head_dim**-0.5,
                 torch.get_num_threads(), ctypes.byref(written))
        positions = (cos, signed_sin, slots, rows_plan.tables, rows_plan.context_lens)

        def store() -> int:
            nonlocal status
            if self.kind == _TILES:  # q is read in place from the qkv rows
                status = self.library.decode_layers_bf16(
                    self.num_layers, self.table, self.final_norm.data_ptr(), self.eps,
                    *(t.data_ptr() for t in (h, x, qkv, attn, tmp, gate_up, act, *positions)), *sizes)
            else:
                status = self.library.decode_layers(
                    self.kind, self.num_layers, self.table, self.final_norm.data_ptr(), self.eps,
                    *(t.data_ptr() for t in (h, x, qkv, q, attn, tmp, gate_up, act, *positions)), *sizes)
            return written.value

        pool.write_layers_by(slots, store)
        if status == -1:
            raise IndexError("a KV slot is outside the pool layer")
        if status != 0:
            raise MemoryError("a decode-loop kernel could not allocate its scratch")
        return x


def _kind(linear: torch.nn.Module, dtype: torch.dtype) -> int | None:
    """The loop's kind for one linear of a model of `dtype`; None where the loop cannot run it."""
    if dtype == torch.bfloat16:
        return _TILES if isinstance(getattr(linear, "tiles", None), torch.Tensor) else None
    panels = getattr(linear, "panels", None)
    if dtype != torch.float32 or not isinstance(panels, torch.Tensor) or panels.dtype not in _KINDS:
        return None
    return _KINDS[panels.dtype]


def _layers(model: CausalLM) -> list[DecoderLayer]:
    return list(model.model.layers)  # type: ignore[arg-type]


def _linears(layer: DecoderLayer) -> tuple[torch.nn.Module, ...]:
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj
