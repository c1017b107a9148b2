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

from kvseal.models.gguf_blocks import GgufBlocks, LayerBlocks, dequantize_rows, sample_rows
from kvseal.models.llama import CausalLM
from kvseal.models.quant import LAYER_LINEARS
from kvseal.ops import Ops

logger = logging.getLogger("kvseal")
_HEAD_SAMPLED_ROWS = 64  # rows of the lm_head's blocks checked against its weight before they are held


def pack_model(model: CausalLM, ops: Ops, *, weight_dtype: torch.dtype | None = None,
               blocks: GgufBlocks | None = None) -> CausalLM:
    """Swap every `nn.Linear` of the decoder layers and the lm_head for `ops.linear(linear,
    weight_dtype)`, in place. Call after the model is in its final dtype; linears already
    swapped (packed, or quantized) are left as they are, so packing twice is harmless.
    weight_dtype: the model's dtype (None), or bfloat16 for a float32 model (`--quantization
    bf16`: ConfigError where the ops cannot store them so). blocks: the GGUF blocks the model's
    bfloat16 weights were converted from (`gguf_blocks`: the decoder linears' Q4_1, the lm_head's
    Q8_0), which the ops may hold for one-row steps (`Ops.hold_q4_1`, `Ops.hold_q8_0`); each part
    held only where its sampled rows dequantize to the weights bit for bit (every decoder linear's,
    for the Q4_1 part)."""
    dtype = model.model.norm.weight.dtype
    target = weight_dtype or dtype
    q4_1, q8_0 = _matching_blocks(model, blocks) if target == dtype == torch.bfloat16 else (None, None)
    held_q4_1 = 0

    def swap(owner: nn.Module, attr: str) -> nn.Module | None:
        linear = getattr(owner, attr)
        if not (isinstance(linear, nn.Linear) and linear.weight.dtype == dtype):
            return None
        packed = ops.linear(linear, target)
        setattr(owner, attr, packed)
        return packed

    for index, layer in enumerate(model.model.layers):
        for owner_name, attr in LAYER_LINEARS:
            packed = swap(getattr(layer, owner_name), attr)
            held_q4_1 += packed is not None and q4_1 is not None and ops.hold_q4_1(packed, q4_1[index][attr])
    head = swap(model, "lm_head")
    held_q8_0 = head is not None and q8_0 is not None and ops.hold_q8_0(head, q8_0)
    kinds = Counter(type(m).__name__ for m in model.modules() if _is_linear(m))
    logger.info("%s linears (weights stored in %s): %s%s%s", dtype, target,
                ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items())),
                f"; {held_q4_1} also as Q4_1 blocks for one-row steps" if q4_1 is not None else "",
                f"; the lm_head also as Q8_0 blocks for one-row steps: {'yes' if held_q8_0 else 'no'}"
                if q8_0 is not None else "")
    return model


def _matching_blocks(model: CausalLM, blocks: GgufBlocks | None) -> tuple[list[LayerBlocks] | None,
                                                                           torch.Tensor | None]:
    """The parts of `blocks` (the decoder linears' Q4_1, the lm_head's Q8_0) that pass their spot
    check against the model's bfloat16 weights, each on its own; None for the others."""
    if blocks is None:
        return None, None
    q4_1 = blocks.layers if blocks.layers is not None and _layers_match(model, blocks.layers) else None
    q8_0 = blocks.head if blocks.head is not None and _head_matches(model, blocks.head) else None
    return q4_1, q8_0


def _layers_match(model: CausalLM, q4_1: list[LayerBlocks]) -> bool:
    """Whether every decoder linear's blocks dequantize, on a few sampled rows, to exactly its
    bfloat16 weight (a spot check that the blocks are the ones the weights came from, rows in
    the same order); logged where not, and then no linear holds them."""
    if len(q4_1) != len(model.model.layers):
        return False
    for index, layer in enumerate(model.model.layers):
        for owner_name, attr in LAYER_LINEARS:
            if not _blocks_match(getattr(getattr(layer, owner_name), attr), q4_1[index][attr],
                                 f"layer {index}'s {attr}"):
                return False
    return True


def _head_matches(model: CausalLM, q8_0: torch.Tensor) -> bool:
    """`_layers_match` for the lm_head's Q8_0 blocks, on more sampled rows (one linear, and the
    largest)."""
    return _blocks_match(model.lm_head, q8_0, "the lm_head", _HEAD_SAMPLED_ROWS)


def _blocks_match(linear: nn.Module, blocks: torch.Tensor, name: str, count: int = 8) -> bool:
    if not isinstance(linear, nn.Linear) or blocks.shape[:2] != (linear.out_features, linear.in_features // 32):
        return False
    rows = sample_rows(linear.out_features, count)
    if not torch.equal(dequantize_rows(blocks[rows]), linear.weight.detach()[rows]):
        logger.warning("%s: its GGUF blocks do not dequantize to its weight; one-row steps read the bfloat16 "
                       "weights", name)
        return False
    return True


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or hasattr(module, "out_features") and hasattr(module, "in_features")
