"""`TritonOps`: the CUDA backend. Attention over the paged pool runs as Triton kernels
(`triton_attention.py`); the linears, norms, RoPE and the argmax are torch's ops on the device
(cuBLAS for the linears, in the model's dtype).

What each attention op reads is the interface's contract (`interface.Ops`): a decode row its own
pages' slots 0..context_len-1, a prefill span its sequence's slots 0..its causal position, a
fresh chunk only its own rows of this forward. The same kernels run on CPU tensors under
`TRITON_INTERPRET=1`, which is how the tests hold this backend to the contract without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kvseal.errors import ConfigError
from kvseal.kvcache.pool import KVPool
from kvseal.ops import triton_attention
from kvseal.ops.interface import DecodeLoop, DecodePlan, DecoderStack, FreshPrefills, NewTokens, PrefillSpan
from kvseal.ops.torch_backend import TorchOps


@dataclass(frozen=True)
class DeviceRows(DecodePlan):
    """The decode rows of one forward, on the pool's device: read by every layer's kernel."""

    tables: torch.Tensor  # [B, max_pages] int32: each row's own pages (padding past them is never read)
    context_lens: torch.Tensor  # [B] int32


class TritonOps(TorchOps):
    """Triton attention over the paged pool; torch's device ops for the rest."""

    name = "triton"

    # ---- attention

    def plan_decode(self, tables: torch.Tensor, context_lens: list[int], pool: KVPool,
                    num_heads: int) -> DecodePlan:
        device = pool.k[0].device
        return DeviceRows(tables.to(device=device, dtype=torch.int32, non_blocking=True),
                          torch.tensor(context_lens, dtype=torch.int32).to(device, non_blocking=True))

    def decode_attention(self, q: torch.Tensor, pool: KVPool, layer: int, plan: DecodePlan) -> torch.Tensor:
        assert isinstance(plan, DeviceRows), "a plan of this backend's plan_decode"
        return triton_attention.paged_decode_attention(q, pool.k[layer], pool.v[layer], plan.tables,
                                                       plan.context_lens)

    def fresh_attention(self, tokens: NewTokens, groups: Sequence[FreshPrefills], out: torch.Tensor) -> None:
        device = tokens.q.device
        for group in groups:
            starts = group.starts.to(device=device, dtype=torch.int32, non_blocking=True)
            lengths = torch.full_like(starts, group.length)
            triton_attention.fresh_prefill_attention(tokens.q, tokens.k, tokens.v, starts, lengths, out,
                                                     group.length)

    def prefix_attention(self, tokens: NewTokens, span: PrefillSpan, pool: KVPool, layer: int,
                         out: torch.Tensor) -> None:
        device = tokens.q.device
        numbers = torch.tensor([span.token_start, span.query_len, span.context_len], dtype=torch.int32).to(device)
        tables = span.pages.to(device=device, dtype=torch.int32, non_blocking=True)[None]
        triton_attention.paged_prefill_attention(tokens.q, pool.k[layer], pool.v[layer], tables, numbers[0:1],
                                                 numbers[1:2], numbers[2:3], out, span.query_len)

    # ---- linears: torch's (cuBLAS) in the model's dtype

    def linear(self, linear: nn.Linear, weight_dtype: torch.dtype) -> nn.Module:
        if weight_dtype != linear.weight.dtype:
            raise ConfigError("quantization bf16 (bfloat16-stored weights of a float32 model) runs on kvseal's CPU "
                              "kernels only; on a GPU give --dtype bfloat16 instead")
        return linear

    def int8_linear(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    model_dtype: torch.dtype) -> nn.Module:
        raise ConfigError("quantization int8 runs on the CPU backends only; on a GPU use --quantization none")

    def decode_loop(self, stack: DecoderStack) -> DecodeLoop | None:
        return None
