"""Linears in torch ops: oneDNN-packed weights, and torch's weight-only int8 kernel.

**oneDNN** (`PackedLinear`): `F.linear` in float32 calls MKL's sgemm, which repacks the weight
into its blocked layout on every call; at the small batches of a decode step (1-32 rows) that
repacking and its small-M kernels dominate. `PackedLinear` packs each weight once, at start-up,
into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the packing Inductor's
CPU backend uses for frozen linears) and multiplies with `torch.ops.mkldnn._linear_pointwise`.
Same inputs, outputs and dtype as `nn.Linear`; the sums may round differently in the last bit
(another sgemm), like any change of BLAS. A bfloat16 model gets it where oneDNN multiplies
bfloat16 (`onednn_bf16`).

**int8** (`Int8PackLinear`): `torch.ops.aten._weight_int8pack_mm`, torch's CPU kernel for a
[out, in] int8 weight with one scale per output channel (the layout gpt-fast and torchao use).
It wants 2-D activations whose dtype equals the scales' dtype; the module keeps its scales in
its compute dtype (`int8_compute_dtype`) and casts the activations to it and the result back.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

# oneDNN chooses its blocked layout for this many rows; other row counts run with the same
# packed weight (checked in tests/ops/test_linears.py).
PACK_ROWS = 32


def onednn_bf16() -> bool:
    """Whether this torch's oneDNN multiplies bfloat16 on this CPU (AVX512-BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """`nn.Linear` (float32 or bfloat16) whose weight is held packed for oneDNN; same inputs
    and outputs."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # An opaque oneDNN tensor: kept as a plain attribute, outside the state dict and `.to()`.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] in the weight's dtype -> [..., out_features]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN-packed"


class SumCopyLinear(nn.Module):
    """A bfloat16 (or float16) linear whose output is its float32 sums, never rounded (+ the bias
    in float32), through a float32 copy of the weight (exact: the products of two bfloat16 values
    are exact in float32) run by `inner_linear` (the backend's float32 linear): twice the weight's
    bytes. x [..., in] in the model's dtype -> [..., out] float32."""

    def __init__(self, linear: nn.Linear, inner_linear: Callable[[nn.Linear], nn.Module]) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        wide = nn.Linear(self.in_features, self.out_features, bias=linear.bias is not None, dtype=torch.float32)
        with torch.no_grad():
            wide.weight.copy_(linear.weight)
            if linear.bias is not None:
                wide.bias.copy_(linear.bias)
        self.inner = inner_linear(wide)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.float())  # type: ignore[no-any-return]


class SumMmLinear(nn.Module):
    """`SumCopyLinear` on CUDA: cuBLAS asked for the bfloat16 product's float32 output
    (`torch.mm(..., out_dtype=torch.float32)`), the weight kept once in the model's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_t = nn.Parameter(linear.weight.detach().t(), requires_grad=False)  # [in, out]
        bias = None if linear.bias is None else linear.bias.detach().float()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.mm(x.reshape(-1, self.in_features), self.weight_t, out_dtype=torch.float32)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


def int8_compute_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The activation dtype torch's int8 kernel runs in for a model of `model_dtype`.

    torch 2.13's `_weight_int8pack_mm` has an AVX-512 kernel for every dtype, but on a CPU
    without AVX-512 its float32 path is a scalar loop (measured 10-30x slower than its bf16
    path at batch 1, and slower than the fp32 matmul it replaces: docs/BENCHMARKS.md), so an
    fp32 model computes its int8 linears in bf16 there. Everywhere else: the model's dtype."""
    if model_dtype == torch.float32 and not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return torch.bfloat16
    return model_dtype


class Int8PackLinear(nn.Module):
    """A linear with an int8 weight [out, in] and per-output-channel scales, multiplied by torch's
    int8pack kernel in `compute_dtype`; same inputs and outputs as the `nn.Linear` it replaces."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.compute_dtype = compute_dtype  # == scale.dtype; a plain attribute, read every call
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale.to(compute_dtype))
        # the result is cast back to x's dtype, then the bias added in it
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out], in x's dtype; the kernel runs in the scales' dtype on 2-D,
        # contiguous rows. A decode step calls this ~120 times with one row, where each extra
        # tensor op costs as much as a small layer's matmul: the 2-D case (every call the model
        # makes) runs the cast in, the kernel and the cast out, nothing else.
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        out = torch.ops.aten._weight_int8pack_mm(flat.to(self.compute_dtype).contiguous(), self.qweight, self.scale)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)

    def int8_weight(self) -> torch.Tensor:
        """Q [out, in] int8."""
        return self.qweight

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, int8pack " \
               f"in {self.compute_dtype}"
