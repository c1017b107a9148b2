"""`TorchOps`: every op in torch's CPU ops. What runs with `--native off`, without a C compiler,
and wherever `NativeOps` has no kernel (another dtype, a head size a kernel does not take).

Each op computes what transformers computes for the same layer, in the same order: RMSNorm
normalizes in float32, casts back, then scales by the weight; RoPE is `x * cos + roll(x) *
signed_sin` (bit-equal to rotate-half); SiLU(gate) * up in the activations' dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvseal.errors import ConfigError
from kvseal.kvcache.pool import KVPool
from kvseal.kvcache.records import RecordKernels
from kvseal.ops import torch_attention, torch_sampling
from kvseal.ops.interface import DecodeLoop, DecodePlan, DecoderStack, FreshPrefills, NewTokens, PrefillSpan
from kvseal.ops.torch_linears import (
    Int8PackLinear,
    PackedLinear,
    SumCopyLinear,
    SumMmLinear,
    int8_compute_dtype,
    onednn_bf16,
)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: normalize in float32, cast back, then scale by the weight. torch's
    fused rms_norm computes exactly that for float32 (bit-equal on CPU), in one op."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Hugging Face's x * cos + rotate_half(x) * sin, with rotate_half(x) = cat(-x2, x1): roll
    gives cat(x2, x1) and the sign sits in signed_sin (negating is exact, so the result is
    bit-equal), in 4 ops instead of 8. x: [T, heads, D]; cos, signed_sin broadcast to it."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


class TorchOps:
    """The torch formulation of every op (see the module docstring)."""

    name = "torch"

    # ---- attention

    def plan_decode(self, tables: torch.Tensor, context_lens: list[int], pool: KVPool,
                    num_heads: int) -> DecodePlan:
        return torch_attention.GatheredRows.build(tables, context_lens, pool, num_heads)

    def decode_attention(self, q: torch.Tensor, pool: KVPool, layer: int, plan: DecodePlan) -> torch.Tensor:
        assert isinstance(plan, torch_attention.GatheredRows), "a plan of this backend's plan_decode"
        return torch_attention.decode_attention(q, pool, layer, plan)

    def fresh_attention(self, tokens: NewTokens, groups: Sequence[FreshPrefills], out: torch.Tensor) -> None:
        torch_attention.fresh_attention(tokens, groups, out)

    def prefix_attention(self, tokens: NewTokens, span: PrefillSpan, pool: KVPool, layer: int,
                         out: torch.Tensor) -> None:
        torch_attention.prefix_attention(tokens, span, pool, layer, out)

    # ---- linears

    def linear(self, linear: nn.Linear, weight_dtype: torch.dtype) -> nn.Module:
        """oneDNN's packing for float32, and for bfloat16 where oneDNN multiplies it; else the
        linear itself. ConfigError for a float32 model's bfloat16-stored weights (the panels)."""
        dtype = linear.weight.dtype
        if weight_dtype != dtype:
            raise ConfigError("quantization bf16 needs kvseal's native kernels, which are off here (--native off, "
                              "or they did not build: no C compiler? see the log); use quantization none or int8")
        packs = (dtype == torch.float32 and torch.backends.mkldnn.is_available()) \
            or (dtype == torch.bfloat16 and onednn_bf16())
        return PackedLinear(linear) if packs else linear

    def takes_gguf_blocks(self) -> bool:
        return False

    def hold_q4_1(self, linear: nn.Module, blocks: torch.Tensor) -> bool:
        """No Q4_1 kernel here: the bfloat16 weights serve every row."""
        return False

    def hold_q8_0(self, linear: nn.Module, blocks: torch.Tensor) -> bool:
        """No Q8_0 kernel here: the bfloat16 weights serve every row."""
        return False

    def partial_sum_linear(self, linear: nn.Linear) -> nn.Module:
        """cuBLAS's float32 output on CUDA; on the CPU a float32 copy of the weight."""
        if linear.weight.device.type == "cuda":
            return SumMmLinear(linear)
        return SumCopyLinear(linear, lambda wide: self.linear(wide, torch.float32))

    def int8_linear(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    model_dtype: torch.dtype) -> nn.Module:
        return Int8PackLinear(qweight, scale, bias, int8_compute_dtype(model_dtype))

    def gate_up_silu(self, x: torch.Tensor, gate_up: nn.Module, inter: int) -> torch.Tensor:
        return silu_mul(gate_up(x))

    # ---- fused per-layer ops

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor) -> torch.Tensor:
        if delta is not None:
            h.add_(delta)
        return rms_norm(h, weight, eps)

    def rope_(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int,
              head_dim: int) -> None:
        rows = qkv[:, : heads * head_dim].view(qkv.shape[0], heads, head_dim)
        rows.copy_(rotate_half(rows, cos[:, None], signed_sin[:, None]))

    def write_kv(self, pool: KVPool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        pool.write(layer, slots, k, v)

    def decode_loop(self, stack: DecoderStack) -> DecodeLoop | None:
        return None

    # ---- the sampler

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        return x.argmax(dim=-1)

    def draw_rows(self, x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  u: torch.Tensor) -> torch.Tensor:
        return torch_sampling.draw_rows(x, temperature, top_p, u)

    def record_kernels(self) -> RecordKernels | None:
        return None  # the records' own torch ops


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * inter] (gate, then up) -> silu(gate) * up [rows, inter]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)
