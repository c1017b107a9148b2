"""Linear layers with packed weights (the CPU engine's default in float32 and bfloat16).

A float32 model gets one of two packings, chosen per process. **Panels** (`PanelLinear`, when the native library
builds, `models/native.py`): the weight in 16-feature column panels, multiplied by kvseal's C
kernel, faster than oneDNN at every batch size measured here (1 to 256 rows; docs/BENCHMARKS.md,
"Round 5"). **oneDNN** (`PackedLinear`, without a C compiler):
`F.linear` in float32 calls MKL's sgemm, which repacks the weight into its blocked layout on
every call; at the small batches of a decode step (1-32 rows) that repacking and its small-M
kernels dominate. `PackedLinear` packs each weight once, at start-up, into oneDNN's blocked
layout (`torch.ops.mkldnn._reorder_linear_weight`, the packing Inductor's CPU backend uses
for frozen linears) and multiplies with `torch.ops.mkldnn._linear_pointwise`. Same inputs,
outputs and dtype as `nn.Linear`; the sums may round differently in the last bit (another
sgemm), like any change of BLAS. Measured in docs/BENCHMARKS.md ("Engine speed, round 2").

A bfloat16 model (`dtype=auto` picks bfloat16 on CPUs with AVX512-BF16 or AMX) gets **tiles**
(`TileLinear`) where the native library runs them: the weight in AMX's tile layout (16 outputs
x 16 k-pairs), multiplied by kvseal's C kernel on AMX tiles, or where the CPU or process has no
AMX on AVX512-BF16 dot products over the same layout (one 64-byte tile row is exactly the
instruction's operand). float32 sums, each output rounded once. At decode sizes they stream
the weights faster than oneDNN on both kinds of host, and at prefill sizes they lead it on
both (docs/BENCHMARKS.md, "Round 11" and "Round 20"). Elsewhere, and
for a width the tiles cannot step through, `PackedLinear` where oneDNN multiplies bfloat16.

Either packed weight replaces the module's weight (no second copy), except for a lm_head tied
to the embedding table, which keeps the table for the lookup: that head costs one extra copy
of the table.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from kvseal.errors import ConfigError
from kvseal.models.llama import CausalLM
from kvseal.models.native import (
    TILE_K_MULTIPLE,
    TILES_NONE,
    NativeLibrary,
    linear_panels,
    linear_tiles,
    native_library,
    pack_panels,
    pack_tiles,
)
from kvseal.models.quant import LAYER_LINEARS

logger = logging.getLogger("kvseal")

# oneDNN chooses its blocked layout for this many rows; other row counts run with the same
# packed weight (checked in tests/models/test_packed.py).
PACK_ROWS = 32


def can_pack(dtype: torch.dtype, quantization: str) -> bool:
    """Packing applies to float32 models (unquantized, or "bf16": bfloat16 panels) with the
    native library or a torch built with oneDNN, and to unquantized bfloat16 models where
    oneDNN multiplies bfloat16."""
    if dtype == torch.bfloat16:
        return quantization == "none" and (tile_library() is not None or onednn_bf16())
    return dtype == torch.float32 and quantization in ("none", "bf16") and (
        native_library() is not None or torch.backends.mkldnn.is_available())


def onednn_bf16() -> bool:
    """Whether this torch's oneDNN multiplies bfloat16 on this CPU (AVX512-BF16 or AMX)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def tile_library() -> NativeLibrary | None:
    """The native library where it can run kvseal's tile linears (on AMX, or on AVX512-BF16
    where the CPU or process has no AMX); else None."""
    library = native_library()
    return library if library is not None and library.tile_engine != TILES_NONE else None


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


class PanelLinear(nn.Module):
    """`nn.Linear` (float32) whose weight is held in column panels for kvseal's C kernel, in
    float32 or (weight_dtype bfloat16) rounded to bfloat16; the arithmetic is float32 either way."""

    def __init__(self, linear: nn.Linear, library: NativeLibrary, weight_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.library = library
        self.panels = nn.Parameter(pack_panels(library, linear.weight, weight_dtype), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().float().clone(),
                                                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] float32 -> [..., out_features]
        return linear_panels(self.library, x, self.panels, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.panels.dtype} panels"


class TileLinear(nn.Module):
    """`nn.Linear` (bfloat16) whose weight is held in AMX's tile layout for kvseal's C kernel
    (`native.linear_tiles`, on AMX or AVX512-BF16): bfloat16 in and out, float32 sums, any row
    count."""

    def __init__(self, linear: nn.Linear, library: NativeLibrary) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.library = library
        self.tiles = nn.Parameter(pack_tiles(library, linear.weight), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] bfloat16 -> [..., out_features]
        return linear_tiles(self.library, x, self.tiles, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tiles"


def pack_model(model: CausalLM, *, panels: bool = True, weight_dtype: torch.dtype = torch.float32) -> CausalLM:
    """Swap every `nn.Linear` of the decoder layers and the lm_head, in place: in a float32
    model for a `PanelLinear` (the native library built and `panels`) or a `PackedLinear`; in a
    bfloat16 model for a `TileLinear` (`tile_library()`, input width a multiple of 32) or else a
    `PackedLinear` (where `onednn_bf16()`). Call after the model is in its final dtype; a model
    of another dtype, or already packed, is left as it is. weight_dtype bfloat16
    (`--quantization bf16`, a float32 model) needs the panels: ConfigError without them."""
    dtype = model.model.norm.weight.dtype
    if dtype == torch.bfloat16:
        return _pack_bf16(model)
    if dtype != torch.float32:
        return model
    library = native_library() if panels else None
    if weight_dtype != torch.float32 and library is None:
        raise ConfigError("quantization bf16 needs kvseal's native kernels, which did not build here "
                          "(no C compiler? see the log); use quantization none or int8")

    def make(linear: nn.Linear) -> nn.Module:
        return PackedLinear(linear) if library is None else PanelLinear(linear, library, weight_dtype)

    swapped = _swap_all(model, make, torch.float32)
    logger.info("float32 linears: %d hold %s weights", swapped,
                "oneDNN-packed" if library is None else f"{weight_dtype} panel")
    return model


def _pack_bf16(model: CausalLM) -> CausalLM:
    tiles, onednn = tile_library(), onednn_bf16()

    def make(linear: nn.Linear) -> nn.Module:
        if tiles is not None and linear.in_features % TILE_K_MULTIPLE == 0:
            return TileLinear(linear, tiles)
        return PackedLinear(linear) if onednn else linear

    swapped = _swap_all(model, make, torch.bfloat16)
    kinds = sorted({type(m).__name__ for m in model.modules() if isinstance(m, (TileLinear, PackedLinear, nn.Linear))})
    logger.info("bfloat16 linears: %d swapped; kinds: %s", swapped, ", ".join(kinds))
    return model


def _swap_all(model: CausalLM, make: Callable[[nn.Linear], nn.Module], dtype: torch.dtype) -> int:
    """Swap the decoder layers' linears and the lm_head of weight dtype `dtype`; how many."""
    swapped = sum(_swap(getattr(layer, owner_name), attr, make, dtype)
                  for layer in model.model.layers for owner_name, attr in LAYER_LINEARS)
    return swapped + _swap(model, "lm_head", make, dtype)


def _swap(owner: nn.Module, attr: str, make: Callable[[nn.Linear], nn.Module], dtype: torch.dtype) -> int:
    linear = getattr(owner, attr)
    if not isinstance(linear, nn.Linear) or linear.weight.dtype != dtype:
        return 0
    setattr(owner, attr, make(linear))
    return 1
