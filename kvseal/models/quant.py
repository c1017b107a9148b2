"""Weight-only int8 quantization of a loaded model's linear layers (`--quantization int8`).

Each weight matrix W [out, in] is stored as int8 Q with one scale per output channel
(symmetric: W ~= Q * scale[:, None], Q in [-127, 127], scale = max|W_row| / 127). Activations
stay floating point; the matmul is `torch.ops.aten._weight_int8pack_mm`, torch's CPU kernel for
exactly this layout (the one gpt-fast and torchao use for weight-only int8 on CPU), which reads
the int8 weights directly: a decode step reads a quarter of the fp32 bytes, half of bf16's.

The kernel wants 2-D activations whose dtype equals the scales' dtype; `Int8Linear` keeps its
scales in its compute dtype and casts the activations to it and the result back (see
`int8_compute_dtype` for why that is bf16 even in an fp32 model on some CPUs).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvseal.config import QUANTIZATIONS
from kvseal.errors import ConfigError
from kvseal.models.llama import CausalLM

# The projections swapped per decoder layer, as (submodule, attribute) paths.
logger = logging.getLogger("kvseal")

LAYER_LINEARS = (("self_attn", "qkv_proj"), ("self_attn", "o_proj"), ("mlp", "gate_up_proj"), ("mlp", "down_proj"))


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (Q [out, in] int8, scale [out] float32)."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)  # zero row: any scale
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 matrix an int8 weight stands for (the reference the kernel must match)."""
    return q.float() * scale.float()[:, None]


class Int8Linear(nn.Module):
    """`nn.Linear` with an int8 weight and per-output-channel scales; same inputs and outputs."""

    qweight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = compute_dtype  # == scale.dtype; a plain attribute, read every call
        q, scale = quantize_int8(linear.weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale.to(compute_dtype))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

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

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_int8(self.qweight, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel"


def int8_compute_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The activation dtype the int8 kernel runs in for a model of `model_dtype`.

    torch 2.13's `_weight_int8pack_mm` has an AVX-512 kernel for every dtype, but on a CPU
    without AVX-512 its float32 path is a scalar loop (measured 10-30x slower than its bf16
    path at batch 1, and slower than the fp32 matmul it replaces: docs/BENCHMARKS.md), so an
    fp32 model computes its int8 linears in bf16 there. Everywhere else: the model's dtype.
    """
    if model_dtype == torch.float32 and not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return torch.bfloat16
    return model_dtype


def check_quantization(mode: str) -> str:
    if mode not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {mode!r}")
    return mode


def quantize_model(model: CausalLM, mode: str, *, lm_head: bool = True) -> CausalLM:
    """Swap the model's linear layers for quantized ones in place (mode "none": unchanged).

    Call after the model is in its final dtype. Every decoder layer's q/k/v, o, gate/up and
    down projections are swapped, and the lm_head when `lm_head` (with tied embeddings the
    embedding table itself stays floating point for the lookup; the head gets an int8 copy).
    Already quantized layers are left alone, so quantizing twice is harmless.
    """
    if check_quantization(mode) != "int8":  # "bf16" is a packing of float32 weights (models/packed.py)
        return model
    dtype = model.model.norm.weight.dtype
    compute_dtype = int8_compute_dtype(dtype)
    swapped = sum(_swap(getattr(layer, owner_name), attr, compute_dtype)
                  for layer in model.model.layers for owner_name, attr in LAYER_LINEARS)
    if lm_head:
        swapped += _swap(model, "lm_head", compute_dtype)
    logger.info("quantization=%s: %d linear layers hold int8 weights (lm_head %s), computed in %s",
                mode, swapped, "included" if lm_head else "kept in " + str(dtype), compute_dtype)
    return model


def _swap(owner: nn.Module, attr: str, compute_dtype: torch.dtype) -> int:
    linear = getattr(owner, attr)
    if not isinstance(linear, nn.Linear):
        return 0
    setattr(owner, attr, Int8Linear(linear, compute_dtype))
    return 1
