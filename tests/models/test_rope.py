"""RoPE rows from the position table (`models/rope.py`) equal the rows computed directly."""

from __future__ import annotations

import pytest
import torch
from tiny_models import CONFIGS

from kvseal.config import ModelConfig
from kvseal.models.rope import MAX_TABLE_POSITIONS, RotaryEmbedding


def _rope() -> RotaryEmbedding:
    return RotaryEmbedding(ModelConfig.from_hf(CONFIGS["llama"]()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_rows_are_bit_equal_to_direct_rows_as_the_table_grows(dtype: torch.dtype) -> None:
    rope = _rope()
    for positions in (torch.tensor([0, 3, 5]), torch.arange(300), torch.tensor([299, 7, 1000, 0, 1000])):
        cos, signed_sin = rope.cos_sin(positions, dtype)
        want_cos, want_sin = rope._rows(positions, dtype)
        assert cos.shape == want_cos.shape == (positions.numel(), 1, want_cos.shape[-1])
        assert torch.equal(cos, want_cos) and torch.equal(signed_sin, want_sin)
    assert rope._tables[dtype][0].shape[0] == 1024  # grown to the next power of two


def test_positions_past_the_table_limit_and_empty_batches_are_computed_directly() -> None:
    rope = _rope()
    positions = torch.tensor([MAX_TABLE_POSITIONS, 5])
    cos, signed_sin = rope.cos_sin(positions, torch.float32)
    want_cos, want_sin = rope._rows(positions, torch.float32)
    assert torch.equal(cos, want_cos) and torch.equal(signed_sin, want_sin)
    assert rope._tables == {}  # no table that long was built
    empty = rope.cos_sin(torch.tensor([], dtype=torch.int64), torch.float32)
    assert empty[0].shape[0] == 0 and empty[1].shape[0] == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_for_a_known_bound_are_the_rows_of_cos_sin(dtype: torch.dtype) -> None:
    """The forward's form: [num_tokens, head_dim] rows, contiguous, given a bound on the positions
    (its longest context), within the table, past its limit, and for no tokens."""
    rope = _rope()
    for positions, bound in ((torch.tensor([4, 0, 9]), 10), (torch.arange(37), 400),
                             (torch.tensor([MAX_TABLE_POSITIONS + 3, 1]), MAX_TABLE_POSITIONS + 4),
                             (torch.tensor([], dtype=torch.int64), 0)):
        cos, signed_sin = rope.cos_sin_rows(positions, dtype, bound)
        want_cos, want_sin = rope._rows(positions, dtype)
        assert cos.is_contiguous() and signed_sin.is_contiguous()
        assert torch.equal(cos, want_cos[:, 0]) and torch.equal(signed_sin, want_sin[:, 0])
