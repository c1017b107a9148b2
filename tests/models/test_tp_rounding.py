"""Tensor parallelism in bfloat16: a row-parallel linear's partial sums stay float32 until the
all-reduce has summed them (`models/tensor_parallel.py`, `WidePartialLinear`), so the sum over
two shards rounds like one rank's whole linear. In-process: the two shards run one after the other."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model
from torch import nn

from kvseal.models.loader import load_model
from kvseal.models.tensor_parallel import WidePartialLinear, widen_row_parallel
from kvseal.ops import select_ops


def _halves(linear: nn.Linear) -> list[tuple[nn.Linear, slice]]:
    """The linear's two row-parallel shards (split along its input features) and their input slices."""
    half = linear.in_features // 2
    shards = []
    for cols in (slice(0, half), slice(half, linear.in_features)):
        shard = nn.Linear(half, linear.out_features, bias=False, dtype=linear.weight.dtype)
        with torch.no_grad():
            shard.weight.copy_(linear.weight[:, cols])
        shards.append((shard, cols))
    return shards


@pytest.mark.parametrize("native", ["off", "auto"])
def test_wide_partials_round_once_like_the_whole_linear(native: str) -> None:
    torch.manual_seed(0)
    ops = select_ops(native)
    linear = nn.Linear(256, 64, bias=False, dtype=torch.bfloat16)
    x = torch.randn(16, 256).to(torch.bfloat16)
    whole = ops.linear(linear, torch.bfloat16)(x)  # one rank: one rounding of the whole sum
    narrow = sum(ops.linear(s, torch.bfloat16)(x[:, cols]).float() for s, cols in _halves(linear))
    wide = [WidePartialLinear(s, ops)(x[:, cols]) for s, cols in _halves(linear)]
    assert all(p.dtype == torch.float32 for p in wide)
    narrow_mismatches = int((narrow.to(torch.bfloat16) != whole).sum())
    wide_mismatches = int((sum(wide).to(torch.bfloat16) != whole).sum())  # type: ignore[union-attr]
    # float32 sums in another order may part on a rare rounding tie; bfloat16 partials part on a third
    assert wide_mismatches <= whole.numel() // 200
    assert narrow_mismatches > whole.numel() // 10


def test_wide_partial_keeps_the_bias_in_float32() -> None:
    linear = nn.Linear(8, 4, bias=True, dtype=torch.bfloat16)
    x = torch.randn(3, 8).to(torch.bfloat16)
    expected = torch.nn.functional.linear(x.double(), linear.weight.double(), linear.bias.double())
    got = WidePartialLinear(linear, select_ops("off"))(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)


def test_widen_swaps_only_the_row_parallel_linears_of_a_bf16_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    folder = make_tiny_model("llama", tmp_path / "llama")
    ops = select_ops("off")
    assert widen_row_parallel(load_model(str(folder), torch.float32).model, ops) == 0
    model = load_model(str(folder), torch.bfloat16).model.to(torch.bfloat16)
    assert widen_row_parallel(model, ops) == 2 * len(model.model.layers)
    for layer in model.model.layers:
        assert isinstance(layer.self_attn.o_proj, WidePartialLinear)
        assert isinstance(layer.mlp.down_proj, WidePartialLinear)
        assert isinstance(layer.self_attn.qkv_proj, nn.Linear) and isinstance(layer.mlp.gate_up_proj, nn.Linear)
