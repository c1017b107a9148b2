"""Linear layers with packed weights (the CPU engine's default in float32 and bfloat16).

`pack_model` swaps every linear of the decoder layers and the lm_head for the module the ops
give it (`Ops.linear`): with the native kernels, a float32 model's weights in kvseal's 16-feature
column panels (faster than oneDNN at every batch size measured here, 1 to 256 rows;
docs/benchmarks-archive.md, "Round 5") and a bfloat16 model's in AMX's tile layout where the build runs
the tile linears (at decode sizes they stream the weights faster than oneDNN on AMX and on
AVX512-BF16 hosts, and lead it at prefill sizes: rounds 11 and 20); with the torch ops, or for a
width the tiles cannot step through, oneDNN's blocked layout where oneDNN multiplies the dtype
(docs/benchmarks-archive.md, "Round 2"). Same inputs, outputs and dtype as `nn.Linear`,
to the last bits of another order of sums.

Either packed weight replaces the module's weight (no second copy), except for a lm_head tied
to the embedding table, which keeps the table for the lookup: that head costs one extra copy
of the table.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from kvseal.models.llama import CausalLM
from kvseal.models.quant import LAYER_LINEARS
from kvseal.ops import Ops

logger = logging.getLogger("kvseal")


def pack_model(model: CausalLM, ops: Ops, *, weight_dtype: torch.dtype | None = None) -> CausalLM:
    """Swap every `nn.Linear` of the decoder layers and the lm_head for `ops.linear(linear,
    weight_dtype)`, in place. Call after the model is in its final dtype; linears already
    swapped (packed, or quantized) are left as they are, so packing twice is harmless.
    weight_dtype: the model's dtype (None), or bfloat16 for a float32 model (`--quantization
    bf16`: ConfigError where the ops cannot store them so)."""
    dtype = model.model.norm.weight.dtype
    target = weight_dtype or dtype

    def swap(owner: nn.Module, attr: str) -> None:
        linear = getattr(owner, attr)
        if isinstance(linear, nn.Linear) and linear.weight.dtype == dtype:
            setattr(owner, attr, ops.linear(linear, target))

    for layer in model.model.layers:
        for owner_name, attr in LAYER_LINEARS:
            swap(getattr(layer, owner_name), attr)
    swap(model, "lm_head")
    kinds = Counter(type(m).__name__ for m in model.modules() if _is_linear(m))
    logger.info("%s linears (weights stored in %s): %s", dtype, target,
                ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items())))
    return model


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or hasattr(module, "out_features") and hasattr(module, "in_features")
