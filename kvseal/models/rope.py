"""Rotary position embedding, with the frequency schedules of Hugging Face's rope types."""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvseal.config import ModelConfig
from kvseal.ops.torch_backend import rotate_half

MAX_TABLE_POSITIONS = 1 << 16


def _rope_parameters(hf: object) -> dict:
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    return dict(params)


class RotaryEmbedding:
    """Rotate-half RoPE (Hugging Face layout). Scaled types reuse transformers' init tables."""

    def __init__(self, cfg: ModelConfig) -> None:
        hf = cfg.hf_config
        params = _rope_parameters(hf)
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type == "default":
            theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
            dims = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device="cpu").float()
            self.inv_freq = 1.0 / (theta ** (dims / cfg.head_dim))
            self.scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
            self.inv_freq, self.scaling = inv_freq.float(), float(scaling)
        # dtype -> (cos, signed_sin) [num_positions, head_dim] for positions 0..num_positions-1
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Computed in float32, then cast to the activations' dtype (as transformers does).
        positions: [num_tokens] -> cos, signed_sin: [num_tokens, 1, head_dim], where signed_sin
        is sin with its first half negated (the sign rotate-half puts on x's second half).

        Rows come from a table of every position up to the largest seen so far (grown to the
        next power of two), the same elementwise float32 arithmetic per position, so the
        values are those of computing them for `positions` directly. Positions past
        MAX_TABLE_POSITIONS are computed directly (a table that long would cost more memory
        than it saves time)."""
        num_positions = int(positions.max()) + 1 if positions.numel() else 0
        if not 0 < num_positions <= MAX_TABLE_POSITIONS:
            return self._rows(positions, dtype)
        cos, signed_sin = self._table(num_positions, dtype)
        return cos[positions][:, None, :], signed_sin[positions][:, None, :]

    def cos_sin_rows(self, positions: torch.Tensor, dtype: torch.dtype,
                     num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`cos_sin` as two contiguous [num_tokens, head_dim] tensors, for a caller that knows a
        bound on the positions: `num_positions` > every position (a forward's longest context),
        so there is no pass over `positions` to find it. The same values."""
        if not 0 < num_positions <= MAX_TABLE_POSITIONS:
            cos, signed_sin = self._rows(positions, dtype)
            return cos[:, 0].contiguous(), signed_sin[:, 0].contiguous()
        cos, signed_sin = self._table(num_positions, dtype)
        return cos[positions], signed_sin[positions]

    def _table(self, num_positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._tables.get(dtype)
        if table is None or table[0].shape[0] < num_positions:
            size = 1 << max(num_positions - 1, 0).bit_length()
            cos, signed_sin = self._rows(torch.arange(size, dtype=torch.int64), dtype)
            table = self._tables[dtype] = (cos[:, 0], signed_sin[:, 0])
        return table

    def _rows(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = (freqs.cos() * self.scaling).to(dtype), (freqs.sin() * self.scaling).to(dtype)
        return torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((-sin, sin), dim=-1)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # x: [num_tokens, heads, head_dim], in the dtype cos_sin was made for (`rotate_half`:
        # Hugging Face's rotate-half RoPE in 4 ops, bit-equal to it)
        cos, signed_sin = cos_sin
        return rotate_half(x, cos, signed_sin)
