"""A GGUF file's quantized weights as their blocks, for the one-row kernels (`Ops.hold_q4_1`,
`Ops.hold_q8_0`): the decoder linears' Q4_1 blocks and the lm_head's Q8_0 ones.

kvseal serves a GGUF's bfloat16 dequantization (`loader.convert_gguf`: bfloat16(float32(d) * q +
float32(m)) for a Q4_1 block, bfloat16(float32(d) * q) for a Q8_0 one). Where every decoder linear
of the file is Q4_1, a one-row step can read their blocks instead (under a third of the bytes)
and compute the same sums (`csrc/linear_q4.c`); where the lm_head is Q8_0 (the tied embedding
table, `token_embd.weight`, or an untied `output.weight`), it can read those (about half the
bytes, `csrc/linear_q8.c`). Each is taken on its own: a file whose decoder linears are of other
types still gives its Q8_0 head. They are read once at load, memory-mapped by the gguf
package's reader, with their rows in the order of kvseal's weights: q and k rows unpermuted as
the conversion unpermutes them, q/k/v and gate/up concatenated as the loader packs them
(`PACKED_MODULES`).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvseal.config import ModelConfig
from kvseal.model_files import gguf_cache_dir
from kvseal.models.llama import PACKED_MODULES
from kvseal.models.loader import hf_name, unpermute_rows

logger = logging.getLogger("kvseal")

Q4_1_BLOCK_BYTES = 20  # float16 d, float16 m, 32 nibbles
Q8_0_BLOCK_BYTES = 34  # float16 d, 32 int8
_BLOCK_TYPES = {Q4_1_BLOCK_BYTES: "Q4_1", Q8_0_BLOCK_BYTES: "Q8_0"}  # a block's bytes -> its GGML type's name
# what a kept file says it is (another layout, such as -1's, the Q4_1 linears alone: read the GGUF again)
_BLOCKS_FORMAT = "kvseal-gguf-blocks-2"
# safetensors, beside the converted folder's weights, never one of them (`*.safetensors`); named when
# it held the Q4_1 linears alone, and kept so, so that the file of an older kvseal is replaced, not left
BLOCKS_FILE = "q4_1.blocks"
_HEAD = "lm_head"  # the kept file's name for the head's blocks
_GGUF_PARTS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
               "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # kvseal's decoder linears

# layer -> kvseal's linear name (qkv_proj, o_proj, gate_up_proj, down_proj) -> [out, in / 32, 20] uint8
LayerBlocks = dict[str, torch.Tensor]


@dataclass(frozen=True)
class GgufBlocks:
    """The blocks of a GGUF that the one-row kernels read, each part None where the file does not
    hold it so."""

    layers: list[LayerBlocks] | None  # every decoder linear's Q4_1 blocks; None unless all are Q4_1
    head: torch.Tensor | None  # the lm_head's Q8_0 blocks [vocab, hidden / 32, 34] uint8

    @property
    def is_empty(self) -> bool:
        return self.layers is None and self.head is None


def read_gguf_blocks(path: Path, config: ModelConfig) -> GgufBlocks:
    """The file's decoder linears as Q4_1 blocks (every one of them, q, k, v, o, gate, up, down of
    every layer, or none) and its lm_head as Q8_0 blocks, each where the file holds it so. Kept
    beside the file's converted folder (`BLOCKS_FILE`) the first time: the gguf package's reader
    parses the whole file's metadata, its tokenizer's arrays too (~2 s of start-up for the default
    model), a safetensors file of the blocks alone loads in a fraction of that."""
    cached = gguf_cache_dir(path) / BLOCKS_FILE
    if cached.exists():
        try:
            return _load_blocks(cached, config.num_layers)
        except Exception as exc:  # a cache file damaged or from another layout: read the GGUF again
            logger.warning("cannot read %s (%s); reading the GGUF's blocks again", cached, exc)
    blocks = _read_gguf_blocks(path, config)
    _keep_blocks(cached, blocks)
    return blocks


def _load_blocks(cached: Path, num_layers: int) -> GgufBlocks:
    """The kept blocks, or ValueError where the file is not exactly what `_keep_blocks` wrote:
    another layout, or bytes changed since (its digest), so a damaged file is never computed with."""
    from safetensors import safe_open

    with safe_open(str(cached), framework="pt") as kept:
        meta = kept.metadata() or {}
        tensors = {name: kept.get_tensor(name) for name in kept.keys()}
    if meta.get("format") != _BLOCKS_FORMAT:
        raise ValueError(f"not a {_BLOCKS_FORMAT} file")
    if meta.get("sha256") != _digest(tensors):
        raise ValueError("its blocks do not match the digest written with them")
    layers = None
    if meta.get("all_q4_1") == "yes":
        layers = [{linear: tensors[f"{index}.{linear}"] for linear in _LINEARS} for index in range(num_layers)]
        if not all(_are_blocks(b, Q4_1_BLOCK_BYTES) for layer in layers for b in layer.values()):
            raise ValueError("its linears are not Q4_1 blocks [out, in / 32, 20] uint8")
    head = tensors[_HEAD] if meta.get("q8_0_head") == "yes" else None
    if head is not None and not _are_blocks(head, Q8_0_BLOCK_BYTES):
        raise ValueError("its head is not Q8_0 blocks [vocab, hidden / 32, 34] uint8")
    return GgufBlocks(layers, head)


def _are_blocks(tensor: torch.Tensor, block_bytes: int) -> bool:
    return tensor.dtype == torch.uint8 and tensor.dim() == 3 and tensor.shape[2] == block_bytes \
        and tensor.is_contiguous()


def _keep_blocks(cached: Path, blocks: GgufBlocks) -> None:
    """Write the blocks (none: no tensor) beside the converted folder, with their digest, whole
    or not at all; where the cache cannot be written, say so and go on (the GGUF is read again
    at the next start)."""
    from safetensors.torch import save_file

    tensors = {f"{index}.{linear}": b for index, layer in enumerate(blocks.layers or []) for linear, b in
               layer.items()}
    if blocks.head is not None:
        tensors[_HEAD] = blocks.head
    meta = {"format": _BLOCKS_FORMAT, "all_q4_1": "yes" if blocks.layers else "no",
            "q8_0_head": "yes" if blocks.head is not None else "no", "sha256": _digest(tensors)}
    tmp = cached.with_name(f".{cached.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, cached)
    except Exception as exc:  # read-only or full (safetensors raises its own error type, no OSError)
        logger.warning("cannot keep the GGUF's blocks in %s (%s); they are read from the GGUF at each start",
                       cached, exc)
        tmp.unlink(missing_ok=True)


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the tensors' names, shapes, dtypes and bytes, in name order (~0.1 s for 66 MB)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)  # the bytes, whatever the dtype
    return digest.hexdigest()


def _read_gguf_blocks(path: Path, config: ModelConfig) -> GgufBlocks:
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    return GgufBlocks(_read_layers(tensors, config), _read_head(tensors, config))


def _read_head(tensors: dict[str, Any], config: ModelConfig) -> torch.Tensor | None:
    """The lm_head's blocks where it is Q8_0: the embedding table's where they are tied (the
    loader's lm_head is then the table, whatever else the file holds), else `output.weight`'s."""
    from gguf import GGMLQuantizationType

    tensor = tensors.get("token_embd.weight" if config.tie_word_embeddings else "output.weight")
    if tensor is None or tensor.tensor_type != GGMLQuantizationType.Q8_0:
        return None
    return torch.from_numpy(np.array(tensor.data).reshape(tensor.data.shape[0], -1, Q8_0_BLOCK_BYTES))


def _read_layers(tensors: dict[str, Any], config: ModelConfig) -> list[LayerBlocks] | None:
    from gguf import GGMLQuantizationType

    layers = []
    for index in range(config.num_layers):
        layer: LayerBlocks = {}
        for linear in _LINEARS:
            parts = []
            for part in PACKED_MODULES.get(linear, (linear,)):
                tensor = tensors.get(f"blk.{index}.{_GGUF_PARTS[part]}.weight")
                if tensor is None or tensor.tensor_type != GGMLQuantizationType.Q4_1:
                    return None
                blocks = torch.from_numpy(np.array(tensor.data).reshape(tensor.data.shape[0], -1, Q4_1_BLOCK_BYTES))
                parts.append(unpermute_rows(hf_name(tensor.name), blocks, config))
            layer[linear] = torch.cat(parts).contiguous()
        layers.append(layer)
    return layers


def dequantize_rows(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 or Q8_0 blocks [rows, in / 32, 20 or 34] uint8 -> the weights [rows, in] bfloat16
    exactly as the loader's conversion computes them (gguf's dequantization in float32, then the
    cast)."""
    from gguf import GGMLQuantizationType, dequantize

    kind = GGMLQuantizationType[_BLOCK_TYPES[blocks.shape[2]]]
    rows = blocks.reshape(blocks.shape[0], -1).numpy()
    return torch.from_numpy(dequantize(rows, kind).copy()).to(torch.bfloat16)


def sample_rows(n_out: int, count: int = 8) -> torch.Tensor:
    """`count` rows spread over [0, n_out), first and last among them: the rows a spot check of
    a linear's blocks against its weight compares."""
    return torch.linspace(0, n_out - 1, steps=min(count, n_out)).round().long().unique()
