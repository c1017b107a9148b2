"""Weight-only int8 quantization of a loaded model's linear layers (`--quantization int8`).

Each weight matrix W [out, in] is stored as int8 Q with one scale per output channel
(symmetric: W ~= Q * scale[:, None], Q in [-127, 127], scale = max|W_row| / 127). Activations
stay floating point. Two kernels read the int8 weights directly (a decode step reads a quarter
of the fp32 bytes, half of bf16's), one chosen per model:

- **kvseal's C kernel** (`native.linear_i8`, float32 models when the native library builds):
  Q held in 16-feature column panels, converted to float32 in registers, float32 activations,
  the scale applied to each output's sum: 1.6-2.7x faster than int8pack at one row on AVX2.
- **`torch.ops.aten._weight_int8pack_mm`** otherwise (bf16 models, or no C compiler): torch's
  CPU kernel for exactly this layout (the one gpt-fast and torchao use). It wants 2-D
  activations whose dtype equals the scales' dtype; `Int8Linear` keeps its scales in its
  compute dtype and casts the activations to it and the result back (see `int8_compute_dtype`
  for why that is bf16 for an fp32 model on CPUs without AVX-512 and without the C kernel).

The quantization (`quantize_int8`) is the same for both: only the arithmetic differs.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from kvseal.config import QUANTIZATIONS
from kvseal.errors import ConfigError
from kvseal.models.llama import CausalLM
from kvseal.models.native import NativeLibrary, linear_i8, native_library, pack_panels_i8, unpack_panels_i8

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
    """`nn.Linear` with an int8 weight and per-output-channel scales; same inputs and outputs.

    With `library` (and compute_dtype float32) the weight is held as int8 panels (`panels`,
    [ceil(out / 16), in, 16]) for kvseal's C kernel; otherwise as `qweight` [out, in] for
    torch's int8pack kernel. Either way one int8 copy."""

    qweight: torch.Tensor  # without the C kernel
    panels: torch.Tensor  # with it
    scale: torch.Tensor

    def __init__(self, linear: nn.Linear, compute_dtype: torch.dtype, library: NativeLibrary | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = compute_dtype  # == scale.dtype; a plain attribute, read every call
        self.library = library if compute_dtype == torch.float32 else None
        q, scale = quantize_int8(linear.weight)
        if self.library is None:
            self.register_buffer("qweight", q)
        else:
            self.register_buffer("panels", pack_panels_i8(self.library, q))
        self.register_buffer("scale", scale.to(compute_dtype))
        # the C kernel adds a float32 bias; int8pack's result is cast back to x's dtype first
        bias = None if linear.bias is None else linear.bias.detach().clone()
        if bias is not None and self.library is not None:
            bias = bias.float()
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.library is not None:  # the C kernel: float32 in and out, any leading shape, bias fused
            return linear_i8(self.library, x, self.panels, self.scale, self.bias, self.out_features)
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
        """Q [out, in] int8, whichever way it is held."""
        return self.qweight if self.library is None else unpack_panels_i8(self.panels, self.out_features)

    def dequantized_weight(self) -> torch.Tensor:
        return dequantize_int8(self.int8_weight(), self.scale)

    def extra_repr(self) -> str:
        kernel = "int8pack" if self.library is None else "panels (C kernel)"
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-channel, {kernel}"


def int8_compute_dtype(model_dtype: torch.dtype, native: bool = False) -> torch.dtype:
    """The activation dtype the int8 kernel runs in for a model of `model_dtype` (`native`:
    kvseal's C kernel is available, which computes float32 models in float32).

    torch 2.13's `_weight_int8pack_mm` has an AVX-512 kernel for every dtype, but on a CPU
    without AVX-512 its float32 path is a scalar loop (measured 10-30x slower than its bf16
    path at batch 1, and slower than the fp32 matmul it replaces: docs/BENCHMARKS.md), so
    without the C kernel an fp32 model computes its int8 linears in bf16 there. Everywhere
    else: the model's dtype.
    """
    if model_dtype == torch.float32 and not native \
            and not torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return torch.bfloat16
    return model_dtype


def check_quantization(mode: str) -> str:
    if mode not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {mode!r}")
    return mode


def quantize_model(model: CausalLM, mode: str, *, lm_head: bool = True, native: bool = True) -> CausalLM:
    """Swap the model's linear layers for quantized ones in place (mode "none": unchanged).

    Call after the model is in its final dtype. Every decoder layer's q/k/v, o, gate/up and
    down projections are swapped, and the lm_head when `lm_head` (with tied embeddings the
    embedding table itself stays floating point for the lookup; the head gets an int8 copy).
    A float32 model's layers use kvseal's C kernel when `native` and the library builds, else
    torch's int8pack. Already quantized layers are left alone, so quantizing twice is harmless.
    """
    if check_quantization(mode) != "int8":  # "bf16" is a packing of float32 weights (models/packed.py)
        return model
    dtype = model.model.norm.weight.dtype
    library = native_library() if native and dtype == torch.float32 else None
    compute_dtype = int8_compute_dtype(dtype, native=library is not None)
    swapped = sum(_swap(getattr(layer, owner_name), attr, compute_dtype, library)
                  for layer in model.model.layers for owner_name, attr in LAYER_LINEARS)
    if lm_head:
        swapped += _swap(model, "lm_head", compute_dtype, library)
    logger.info("quantization=%s: %d linear layers hold int8 weights (lm_head %s), computed in %s by %s",
                mode, swapped, "included" if lm_head else "kept in " + str(dtype), compute_dtype,
                "int8pack" if library is None else "kvseal's C kernel")
    return model


def _swap(owner: nn.Module, attr: str, compute_dtype: torch.dtype, library: NativeLibrary | None) -> int:
    linear = getattr(owner, attr)
    if not isinstance(linear, nn.Linear):
        return 0
    setattr(owner, attr, Int8Linear(linear, compute_dtype, library))
    return 1
