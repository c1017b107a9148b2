"""How a Llama-family decoder splits over tensor-parallel ranks (Megatron-style).

Rank r of N holds:

- a contiguous block of KV heads and the query heads of their groups (q/k/v by columns, o by
  rows). With N > num_kv_heads each KV head is replicated on N / num_kv_heads ranks, which
  split its query group between them (as vLLM does). KV heads that do not divide by N are
  split as evenly as they go (the first ranks hold one more); the pool of such a rank is the
  largest, and every rank holds the same number of pages (`capacity.KvCapacity.for_dims`
  sizes pages by ceil(num_kv_heads / N), so the smallest per-rank pool is what start-up checks).
- a block of the MLP's intermediate features (gate/up by columns, down by rows);
- a block of ceil(vocab / N) rows of the embedding table and of the lm_head (the last rank's
  block padded with zero rows).

The forward then needs one all-reduce after o_proj, one after down_proj, one after the
embedding lookup (each rank looks up only its own rows) and a gather of the lm_head's logits
(`RankCollectives`). Norms, RoPE and q/k norms are replicated.

Rounding: in a bfloat16 (or float16) model the row-parallel linears' partial sums stay float32
(`WidePartialLinear`), are all-reduced in float32 and rounded to the model's dtype once, where
one rank's linear rounds its whole sum: so TP=N is greedy-equal to TP=1 (the sums differ only in
float32 order), where partials each rounded to bfloat16 part from it within a few tokens. The
embedding's all-reduce needs no widening: every position holds one rank's row and zeros
elsewhere, a sum that is exact in any dtype.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from kvseal.config import ModelConfig
from kvseal.errors import ConfigError
from kvseal.ops import Ops

ROW_PARALLEL_LINEARS = (("self_attn", "o_proj"), ("mlp", "down_proj"))  # their outputs are summed over ranks


class RankCollectives(Protocol):
    """The collectives a sharded forward calls; every rank calls each in the same order."""

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum `t` over the ranks, in place."""

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [rows, vocab_per_rank] on every rank -> [rows, vocab_per_rank * N] on rank 0
        (rank order); other ranks get their input back."""


def _split(total: int, num_parts: int, part: int) -> tuple[int, int]:
    """(start, size) of part `part` when `total` is split as evenly as it goes, the first parts larger."""
    base, extra = divmod(total, num_parts)
    start = part * base + min(part, extra)
    return start, base + (1 if part < extra else 0)


@dataclass(frozen=True)
class RankLayout:
    """Which slice of every weight rank `rank` of `tp` holds."""

    rank: int
    tp: int
    head_dim: int
    head_start: int
    num_heads: int
    kv_head_start: int
    num_kv_heads: int
    inter_start: int
    inter_size: int
    vocab_start: int
    vocab_per_rank: int
    vocab_size: int  # the model's, all ranks together

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int, tp: int) -> RankLayout:
        """The layout, or ConfigError where the model cannot be split over `tp` ranks."""
        check_splittable(cfg, tp)
        if not 0 <= rank < tp:
            raise ConfigError(f"rank {rank} is outside 0..{tp - 1}")
        group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
        if tp <= cfg.num_kv_heads:
            kv_start, num_kv = _split(cfg.num_kv_heads, tp, rank)
            head_start, num_heads = kv_start * group, num_kv * group
        else:  # each KV head on tp / num_kv_heads ranks, which split its query group
            replicas = tp // cfg.num_kv_heads
            kv_start, num_kv = rank // replicas, 1
            num_heads = group // replicas
            head_start = kv_start * group + (rank % replicas) * num_heads
        inter_start, inter_size = _split(cfg.intermediate_size, tp, rank)
        vocab_per_rank = math.ceil(cfg.vocab_size / tp)
        return cls(rank, tp, cfg.head_dim, head_start, num_heads, kv_start, num_kv, inter_start, inter_size,
                   rank * vocab_per_rank, vocab_per_rank, cfg.vocab_size)

    def rank_config(self, cfg: ModelConfig) -> ModelConfig:
        """The model this rank builds: its heads, KV heads, MLP features and vocabulary rows."""
        return dataclasses.replace(cfg, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.inter_size, vocab_size=self.vocab_per_rank)

    def shard(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of checkpoint tensor `name` (Hugging Face naming)."""
        d = self.head_dim
        q_rows = slice(self.head_start * d, (self.head_start + self.num_heads) * d)
        kv_rows = slice(self.kv_head_start * d, (self.kv_head_start + self.num_kv_heads) * d)
        inter = slice(self.inter_start, self.inter_start + self.inter_size)
        if ".q_proj." in name:
            return t[q_rows]
        if ".k_proj." in name or ".v_proj." in name:
            return t[kv_rows]
        if ".o_proj.weight" in name:
            return t[:, q_rows]
        if ".o_proj.bias" in name:  # added once: on rank 0
            return t if self.rank == 0 else torch.zeros_like(t)
        if ".gate_proj." in name or ".up_proj." in name:
            return t[inter]
        if ".down_proj.weight" in name:
            return t[:, inter]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = t[self.vocab_start:self.vocab_start + self.vocab_per_rank]
            padding = self.vocab_per_rank - rows.shape[0]
            return torch.cat([rows, rows.new_zeros(padding, *rows.shape[1:])]) if padding else rows
        return t  # norms: replicated

    def embed(self, table: torch.nn.Embedding, input_ids: torch.Tensor, comm: RankCollectives) -> torch.Tensor:
        """[num_tokens, hidden]: each rank looks up the ids in its rows (zeros elsewhere), then the sum."""
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_per_rank)
        h = table(local.masked_fill(outside, 0))
        h.masked_fill_(outside[:, None], 0)
        comm.all_reduce(h)
        return h


def check_splittable(cfg: ModelConfig, tp: int) -> None:
    """ConfigError unless the model's attention splits over `tp` ranks."""
    if tp < 1:
        raise ConfigError(f"tensor_parallel_size must be >= 1, got {tp}")
    if tp <= cfg.num_kv_heads:
        return
    group = cfg.num_heads // cfg.num_kv_heads
    if tp % cfg.num_kv_heads or group % (tp // cfg.num_kv_heads):
        raise ConfigError(
            f"tensor_parallel_size={tp} exceeds the model's {cfg.num_kv_heads} KV heads, so each KV head is "
            f"replicated; that needs tp to be a multiple of the KV heads and each KV head's {group} query heads "
            f"to split evenly over its replicas. Use tensor_parallel_size <= {cfg.num_kv_heads}")


class WidePartialLinear(nn.Module):
    """A row-parallel linear's shard whose output, this rank's partial sum, is float32: x [..., in]
    in the model's dtype -> [..., out] float32, every product and sum of the model's-dtype linear
    carried in float32 and never rounded (bfloat16 products are exact in float32). The caller
    all-reduces it and rounds once (`CausalLM._reduced`). The ops run it
    (`Ops.partial_sum_linear`): kvseal's tile kernels with a float32 output where they run (the
    weight held once, as tiles), cuBLAS's float32 output on CUDA, else a float32 copy of the
    weight (twice its bytes)."""

    def __init__(self, linear: nn.Linear, ops: Ops) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.inner = ops.partial_sum_linear(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float32 partial sums"


def widen_row_parallel(model: nn.Module, ops: Ops) -> int:
    """Swap each decoder layer's o_proj and down_proj `nn.Linear` in a non-float32 model for a
    `WidePartialLinear`, in place; returns how many were swapped (float32 models: none, their
    partials are float32 already)."""
    count = 0
    for layer in model.model.layers:  # type: ignore[union-attr]
        for owner_name, attr in ROW_PARALLEL_LINEARS:
            owner = getattr(layer, owner_name)
            linear = getattr(owner, attr)
            if isinstance(linear, nn.Linear) and linear.weight.dtype != torch.float32:
                setattr(owner, attr, WidePartialLinear(linear, ops))
                count += 1
    return count
