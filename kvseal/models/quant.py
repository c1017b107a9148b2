"""Weight-only int8 quantization of a loaded model's linear layers (`--quantization int8`).

Each weight matrix W [out, in] is stored as int8 Q with one scale per output channel
(symmetric: W ~= Q * scale[:, None], Q in [-127, 127], scale = max|W_row| / 127). Activations
stay floating point. The ops give the module that multiplies by Q (`Ops.int8_linear`); a decode
step reads a quarter of the fp32 bytes, half of bf16's:

- **kvseal's C kernel** (float32 models with the native kernels): Q held in 16-feature column
  panels, converted to float32 in registers, float32 activations, the scale applied to each
  output's sum: 1.6-2.7x faster than int8pack at one row on AVX2.
- **`torch.ops.aten._weight_int8pack_mm`** otherwise (bf16 models, or the torch ops): torch's
  CPU kernel for exactly this layout, in the model's dtype (bf16 for an fp32 model on CPUs
  without AVX-512: `ops.torch_linears.int8_compute_dtype`).

The quantization (`quantize_int8`) is the same for both: only the arithmetic differs.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch
from torch import nn

from kvseal.config import QUANTIZATIONS
from kvseal.errors import ConfigError
from kvseal.models.llama import CausalLM
from kvseal.ops import Ops

logger = logging.getLogger("kvseal")

# The projections swapped per decoder layer, as (submodule, attribute) paths.
LAYER_LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


class Int8Linear(Protocol):
    """What `Ops.int8_linear` gives: a module with its int8 weight and per-channel scales."""

    scale: torch.Tensor

    def int8_weight(self) -> torch.Tensor: ...


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (Q [out, in] int8, scale [out] float32)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)  # zero row: any scale
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 matrix an int8 weight stands for (the reference the kernel must match)."""
    return q.float() * scale.float()[:, None]


def dequantized_weight(linear: Int8Linear) -> torch.Tensor:
    return dequantize_int8(linear.int8_weight(), linear.scale)


def check_quantization(mode: str) -> str:
    if mode not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {mode!r}")
    return mode


def quantize_model(model: CausalLM, mode: str, ops: Ops, *, lm_head: bool = True) -> CausalLM:
    """Swap the model's linear layers for quantized ones in place (mode "none": unchanged).

    Call after the model is in its final dtype. Every decoder layer's q/k/v, o, gate/up and
    down projections are swapped, and the lm_head when `lm_head` (with tied embeddings the
    embedding table itself stays floating point for the lookup; the head gets an int8 copy),
    each for `ops.int8_linear` of its quantized weight. Already quantized layers are left
    alone, so quantizing twice is harmless.
    """
    if check_quantization(mode) != "int8":  # "bf16" is a packing of float32 weights (models/packed.py)
        return model
    dtype = model.model.norm.weight.dtype
    swapped = [m for layer in model.model.layers for owner_name, attr in LAYER_LINEARS
               if (m := _swap(getattr(layer, owner_name), attr, dtype, ops)) is not None]
    if lm_head and (head := _swap(model, "lm_head", dtype, ops)) is not None:
        swapped.append(head)
    logger.info("quantization=%s: %d linear layers hold int8 weights (lm_head %s): %s", mode, len(swapped),
                "included" if lm_head else "kept in " + str(dtype), swapped[0].extra_repr() if swapped else "")
    return model


def _swap(owner: nn.Module, attr: str, dtype: torch.dtype, ops: Ops) -> nn.Module | None:
    linear = getattr(owner, attr)
    if not isinstance(linear, nn.Linear):
        return None
    q, scale = quantize_int8(linear.weight)
    quantized = ops.int8_linear(q, scale, linear.bias, dtype)
    setattr(owner, attr, quantized)
    return quantized
