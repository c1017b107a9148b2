"""Linears over kvseal's packed weights (the C kernels of `csrc/linear_*.c`).

A float32 model's linears hold their weight in 16-feature column panels (`PanelLinear`, float32
or, for `--quantization bf16`, bfloat16-stored; `Int8PanelLinear` for `--quantization int8`);
a bfloat16 model's hold it in AMX's tile layout (`TileLinear`, on AMX or AVX512-BF16 dot
products). Each packed weight replaces the module's weight (no second copy), except for a
lm_head tied to the embedding table, which keeps the table for the lookup: that head costs one
extra copy of the table. The decode loop (`native_decode_loop.py`) reads these modules'
weights directly.
"""

from __future__ import annotations

import torch
from torch import nn

from kvseal.ops.native_kernels import NativeKernels, unpack_panels_i8


class PanelLinear(nn.Module):
    """`nn.Linear` (float32) whose weight is held in column panels for kvseal's C kernel, in
    float32 or (weight_dtype bfloat16) rounded to bfloat16; the arithmetic is float32 either way."""

    panels: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, kernels: NativeKernels, weight_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernels = kernels
        self.panels = nn.Parameter(kernels.pack_panels(linear.weight, weight_dtype), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float().clone(),
                                                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] float32 -> [..., out_features]
        return self.kernels.linear_panels(x, self.panels, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.panels.dtype} panels"


class _TileWeights(nn.Module):
    """A bfloat16 linear's weight in AMX's tile layout for kvseal's C kernels (the weight held
    once, as tiles), and its bias in `bias_dtype`."""

    tiles: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear, kernels: NativeKernels, bias_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.kernels = kernels
        self.tiles = nn.Parameter(kernels.pack_tiles(linear.weight), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(bias_dtype).clone(),
                                                                   requires_grad=False)


class TileLinear(_TileWeights):
    """`nn.Linear` (bfloat16) whose weight is held in AMX's tile layout for kvseal's C kernel
    (`NativeKernels.linear_tiles`, on AMX or AVX512-BF16): bfloat16 in and out, float32 sums,
    any row count. With `q4_1` (`hold_q4_1`: a decoder linear) or `q8_0` (`hold_q8_0`: the
    lm_head), a single row is multiplied by the GGUF blocks its weight was dequantized from where
    the row kernel runs (`linear_q4_1_row`, `linear_q8_0_row`: bit-equal to the tiles on
    AVX512-BF16, a third or about half of their bytes); the decode loop reads the same Q4_1
    blocks."""

    q4_1: torch.Tensor | None
    q8_0: torch.Tensor | None

    def __init__(self, linear: nn.Linear, kernels: NativeKernels) -> None:
        super().__init__(linear, kernels, torch.bfloat16)
        self.register_buffer("q4_1", None)
        self.register_buffer("q8_0", None)

    def hold_q4_1(self, blocks: torch.Tensor) -> None:
        """Also hold the weight as blocks [out_features, in_features / 32, 20] uint8 (GGUF Q4_1),
        packed for the row kernel. The caller vouches that they dequantize to exactly this
        linear's weight (the loader's conversion: bfloat16(float32(d) * q + float32(m)))."""
        self._check_blocks(blocks, "Q4_1")
        self.q4_1, self.q8_0 = self.kernels.pack_q4_1(blocks), None

    def hold_q8_0(self, blocks: torch.Tensor) -> None:
        """`hold_q4_1` for blocks [out_features, in_features / 32, 34] uint8 (GGUF Q8_0; the
        loader's conversion: bfloat16(float32(d) * q))."""
        self._check_blocks(blocks, "Q8_0")
        self.q4_1, self.q8_0 = None, self.kernels.pack_q8_0(blocks)

    def _check_blocks(self, blocks: torch.Tensor, kind: str) -> None:
        if blocks.shape[:2] != (self.out_features, self.in_features // 32):
            raise TypeError(f"{kind} blocks {tuple(blocks.shape)} are not a [{self.out_features}, "
                            f"{self.in_features}] weight's")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] bfloat16 -> [..., out_features]
        if x.dim() == 2 and x.shape[0] == 1 and x.is_contiguous() and (y := self._row(x)) is not None:
            return y
        return self.kernels.linear_tiles(x, self.tiles, self.bias, self.out_features)

    def _row(self, x: torch.Tensor) -> torch.Tensor | None:
        """One row over the blocks held; None where none are or the row kernel declines."""
        if self.q4_1 is not None:
            return self.kernels.linear_q4_1_row(x, self.q4_1, self.bias, self.out_features)
        if self.q8_0 is not None:
            return self.kernels.linear_q8_0_row(x, self.q8_0, self.bias, self.out_features)
        return None

    def extra_repr(self) -> str:
        blocks = ", Q4_1 blocks for one row" if self.q4_1 is not None else ""
        blocks += ", Q8_0 blocks for one row" if self.q8_0 is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, tiles{blocks}"


class SumTileLinear(_TileWeights):
    """A bfloat16 linear over tiles whose output is its float32 sums, never rounded (+ the bias in
    float32): x [..., in] bfloat16 -> [..., out] float32 (`Ops.partial_sum_linear`). Not a
    `TileLinear`: the decode loop and the fused gate/up never take it for one."""

    def __init__(self, linear: nn.Linear, kernels: NativeKernels) -> None:
        super().__init__(linear, kernels, torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.linear_tiles_f32(x, self.tiles, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tiles, float32 sums"


class Int8PanelLinear(nn.Module):
    """A float32 model's linear with an int8 weight held in 16-feature column panels
    ([ceil(out / 16), in, 16]) and one float32 scale per output channel, for kvseal's C kernel:
    weights converted to float32 in registers, float32 activations, the scale applied to each
    output's sum, the bias (float32) added. One int8 copy of the weight."""

    panels: torch.Tensor
    scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 kernels: NativeKernels) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.kernels = kernels
        self.register_buffer("panels", kernels.pack_panels_i8(qweight))
        self.register_buffer("scale", scale.float())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 in and out, any leading shape, bias fused
        return self.kernels.linear_i8(x, self.panels, self.scale, self.bias, self.out_features)

    def int8_weight(self) -> torch.Tensor:
        """Q [out, in] int8."""
        return unpack_panels_i8(self.panels, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, panels (C kernel)"
