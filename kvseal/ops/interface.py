"""The ops layer's interface: every kernel the model code and the sampler call.

One backend runs per engine (`dispatch.select_ops`): `TorchOps` (torch's CPU ops, anywhere),
`NativeOps` (kvseal's C kernels built for this CPU, `TorchOps` wherever a kernel does not apply).
Model code holds an `Ops` and never asks which one it is. A new backend (CUDA/Triton) is a new
file with a class that implements `Ops`, and one line in `dispatch.BACKENDS`.

**Isolation (I4).** Of the KV pool, an attention op reads only the slots it is told a row owns:
a decode row its own pages through its table, slots 0..context_len-1; a chunk after a cached
prefix its own pages' slots 0..prefix-1. A fresh chunk reads no pool at all, only its own rows
of this forward. Padding in a table is the row's own last page, never another request's. The
kernel tests hold every backend to this with every other slot of the pool NaN.

Shapes: T tokens in the forward, B decode rows, H query heads, KV key/value heads, D head_dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from kvseal.kvcache.pool import KVPool
from kvseal.kvcache.records import RecordKernels


@dataclass(frozen=True)
class NewTokens:
    """This forward's tokens as attention reads them, after RoPE: q [T, H, D]; k, v [T, KV, D],
    exactly as written to the pool (the pool's dtype). qkv: the fused projection rows that q, k
    and v are the column blocks of ([T, (H + 2 KV) D], contiguous), or None where they are not
    (per-head q/k norms)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    qkv: torch.Tensor | None


@dataclass(frozen=True)
class FreshPrefills:
    """Chunks starting at position 0, all `length` tokens long: each attends causally to its own
    tokens only."""

    length: int
    # [num_chunks * length] into the flattened tokens; None: the chunks lie back to back from
    # token_start (one chunk, or several in a row), so their tokens are one span, viewed not gathered
    token_idx: torch.Tensor | None
    token_start: int
    starts: torch.Tensor  # [num_chunks] int64: each chunk's first token

    def rows(self) -> slice | torch.Tensor:
        """The group's tokens: one span, or their indices."""
        if self.token_idx is None:
            return slice(self.token_start, self.token_start + self.starts.numel() * self.length)
        return self.token_idx


@dataclass(frozen=True)
class PrefillSpan:
    """A prefill chunk after a cached prefix: tokens token_start..token_end-1 of the forward at
    positions context_len - query_len..context_len-1; attends to its sequence's slots
    0..context_len-1 through `pages` (its own; the new tokens' slots are written before)."""

    token_start: int
    token_end: int
    pages: torch.Tensor  # [num_pages] int64
    context_len: int
    mask: torch.Tensor  # [query_len, context_len] bool: key j visible to query i
    starts: torch.Tensor  # [1] int64: token_start

    @property
    def query_len(self) -> int:
        return self.token_end - self.token_start


class DecodePlan:
    """One backend's per-forward state for its decode rows (built once by `plan_decode`, read by
    every layer's `decode_attention`); opaque to model code."""


@dataclass(frozen=True)
class DecoderWeights:
    """One decoder layer as a decode loop runs it (no per-head q/k norms)."""

    qkv_proj: nn.Module
    o_proj: nn.Module
    gate_up_proj: nn.Module
    down_proj: nn.Module
    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # [hidden]
    input_eps: float
    post_eps: float


@dataclass(frozen=True)
class DecoderStack:
    """The decoder a decode loop runs: its layers, the final norm and the sizes."""

    layers: tuple[DecoderWeights, ...]
    final_norm: torch.Tensor
    final_eps: float
    hidden: int
    inter: int
    heads: int
    kv_heads: int
    head_dim: int


class DecodeLoop(Protocol):
    """Every layer of a decode-only step in one call (a backend's `decode_loop`), and where the
    backend can, every layer of a prefill step (fresh chunks and chunks after a cached prefix)
    after its decode rows, if any."""

    def takes(self, plan: DecodePlan) -> bool:
        """Whether `run` takes a step whose decode rows this plan describes."""

    def run(self, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, slots: torch.Tensor,
            plan: DecodePlan, pool: KVPool) -> torch.Tensor:
        """h [B, hidden]: the embedded tokens, updated in place into the residual stream; cos,
        signed_sin [B, D]; slots [B]: where each row's K/V goes. Returns the final-normed stream
        [B, hidden] (the lm_head's input), bit-equal to the per-layer ops. Writes each layer's
        K/V through the pool's recorded write (`KVPool.write_layers_by`); IndexError, writing
        nothing more, for a slot outside the pool."""

    def takes_fresh(self, groups: Sequence[FreshPrefills], spans: Sequence[PrefillSpan],
                    decode: DecodePlan | None) -> bool:
        """Whether `run_fresh` takes a step of `decode`'s rows (none: no decode rows) as its first
        tokens, then these groups' fresh chunks and these chunks after a cached prefix, and
        nothing else."""

    def run_fresh(self, h: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, slots: torch.Tensor,
                  groups: Sequence[FreshPrefills], spans: Sequence[PrefillSpan], decode: DecodePlan | None,
                  sampled: torch.Tensor, pool: KVPool) -> torch.Tensor:
        """`run` for a prefill step: `decode`'s rows (if any) first, then over every other row the
        fresh chunks of `groups` (of one length each, in any order) and the `spans` (chunks that
        continue a cached prefix): each decode row attends to its own slots, each fresh chunk to
        its own tokens, each span to its own tokens and its prefix's slots through its own pages.
        Returns the final-normed stream of the `sampled` tokens only ([len(sampled), hidden]; the
        last layer's tail runs on those alone), bit-equal to the per-layer ops; the pool's writes
        as `run`'s."""


class Ops(Protocol):
    """The kernels of one backend. Every op takes and returns CPU tensors of the model's dtype
    unless it says otherwise, and leaves its inputs unchanged unless it says in place."""

    name: str  # "native", "torch", ...

    # ---- attention over the paged pool

    def plan_decode(self, tables: torch.Tensor, context_lens: list[int], pool: KVPool,
                    num_heads: int) -> DecodePlan:
        """The decode rows of one forward: tables [B, max_pages] int64, each row its own pages
        padded with its own last page; context_lens: each row's slots to attend (>= 1)."""

    def decode_attention(self, q: torch.Tensor, pool: KVPool, layer: int, plan: DecodePlan) -> torch.Tensor:
        """q [B, H, D] (any strides) -> [B, H, D]: each row's query over its own slots
        0..context_len-1 of `layer`, softmax in float32. Reads no other slot."""

    def fresh_attention(self, tokens: NewTokens, groups: Sequence[FreshPrefills], out: torch.Tensor) -> None:
        """Causal attention of each chunk of `groups` over its own tokens (k, v of this forward),
        written into its rows of out [T, H, D] (contiguous); no other row of out is written and
        the pool is not read."""

    def prefix_attention(self, tokens: NewTokens, span: PrefillSpan, pool: KVPool, layer: int,
                         out: torch.Tensor) -> None:
        """Causal attention of the span's tokens over its sequence's slots 0..context_len-1 of
        `layer` (the cached prefix through span.pages, then its own new tokens, already written),
        into its rows of out [T, H, D]. Reads no other slot."""

    # ---- linears

    def linear(self, linear: nn.Linear, weight_dtype: torch.dtype) -> nn.Module:
        """The module that runs `linear` (its weight in the model's dtype) with the weight stored
        in `weight_dtype` (the model's; or bfloat16 for a float32 model: `--quantization bf16`):
        same inputs and outputs as `linear`, to the last bits of another order of sums. The
        linear itself where nothing faster applies. ConfigError where this backend cannot store
        weights in `weight_dtype`."""

    def takes_gguf_blocks(self) -> bool:
        """Whether `hold_q4_1` and `hold_q8_0` can hold blocks at all here (so a caller reads none
        it would drop)."""

    def hold_q4_1(self, linear: nn.Module, blocks: torch.Tensor) -> bool:
        """Give `linear` (a module `linear()` returned) its weight a second time, as the GGUF Q4_1
        blocks [out, in / 32, 20] uint8 it was dequantized from (bfloat16(d * q + m), bit for bit:
        the caller vouches), for steps of one row, whose outputs stay bit-equal to its own. False,
        holding nothing, where the backend has no such kernel for it."""

    def hold_q8_0(self, linear: nn.Module, blocks: torch.Tensor) -> bool:
        """`hold_q4_1` for GGUF Q8_0 blocks [out, in / 32, 34] uint8 (bfloat16(d * q)): the
        lm_head's."""

    def partial_sum_linear(self, linear: nn.Linear) -> nn.Module:
        """A module for `linear` (bfloat16 or float16) whose output is its float32 sums, never
        rounded, plus the bias in float32: x [..., in] in the linear's dtype -> [..., out]
        float32. A tensor-parallel rank's row-parallel linear: the ranks' partial sums are
        added before their one rounding, as one rank's whole linear rounds."""

    def int8_linear(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                    model_dtype: torch.dtype) -> nn.Module:
        """A linear of a `model_dtype` model whose weight is qweight [out, in] int8 times
        scale [out] (one per output channel), plus bias: x [..., in] -> [..., out] in x's dtype.
        The module has `int8_weight()` (the [out, in] int8 weight) and `scale`."""

    def gate_up_silu(self, x: torch.Tensor, gate_up: nn.Module, inter: int) -> torch.Tensor:
        """silu(x W_gate^T) * (x W_up^T) [rows, inter] for the MLP's fused gate/up linear
        ([2 * inter, in]: gate, then up) and x [rows, in]."""

    # ---- fused per-layer ops

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor) -> torch.Tensor:
        """The residual add then RMSNorm: h [rows, dim] += delta (unless None), in place, and the
        result's norm h / sqrt(mean(h^2) + eps) * weight, rounded where transformers' RMSNorm
        rounds. out: a [rows, dim] buffer the result may be written into; use the returned
        tensor."""

    def rope_(self, qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int,
              head_dim: int) -> None:
        """Rotate-half RoPE in place on the first `heads` heads of each row of qkv [T, width]
        (contiguous): x * cos + roll(x, D / 2) * signed_sin, cos and signed_sin [T, D]."""

    def write_kv(self, pool: KVPool, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, KV, D] at slots [T] of `layer`, recorded as `KVPool.write` records it
        (the record is what the next forward's isolation check reads). A slot outside the layer
        is an IndexError, not recorded (the native kernel checks every slot first and then writes
        nothing)."""

    def decode_loop(self, stack: DecoderStack) -> DecodeLoop | None:
        """All layers of a decode-only step in one call for this decoder, or None (where the
        backend has none, or the model is not one it runs)."""

    # ---- the sampler

    def argmax_rows(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, n] -> [rows] int64: `x.argmax(dim=-1)` (the first index of the largest value;
        the first NaN where a row has one); bfloat16 rows as their float32 widening."""

    def draw_rows(self, x: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                  u: torch.Tensor) -> torch.Tensor:
        """x [rows, n] logits, temperature [rows] float32 (> 0), top_p [rows] float32 (1: no
        cut), u [rows] float64 in [0, 1) -> [rows] int64: per row, the first token whose
        cumulative weight exceeds u x the total, weights softmax(x / temperature) cut to the
        top-p nucleus (inverse-CDF sampling; `torch_sampling.py`)."""

    # ---- the isolation records

    def record_kernels(self) -> RecordKernels | None:
        """Kernels for the always-on check (I3, I4) and the write records' growth
        (`kvcache/records.py`), or None: the records' own torch ops. Either gives the same
        answer; the check runs before every forward whichever it is."""
