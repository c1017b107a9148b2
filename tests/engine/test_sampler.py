"""The sampler on the model's own logits dtype: a batch of plain greedy rows takes the argmax of
the bfloat16 rows as they are, and anything else (a processor, logprobs, a random row) runs on
their float32 widening. Either way the tokens are those of the float32 logits."""

from __future__ import annotations

import pytest
import torch
from built_kernels import KERNELS, native_ops

from kvseal import SamplingParams
from kvseal.engine.logits_processors import apply_logits_processors, changes_logits
from kvseal.engine.sampler import sample
from kvseal.ops import Ops, TorchOps
from kvseal.types import Request

VOCAB = 1000
EOS = (3,)


def _logits(rows: int, seed: int) -> torch.Tensor:
    """bfloat16 logits with ties (values on a coarse grid) and a row whose maximum is repeated."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, VOCAB, generator=generator) * 4).round().div(2).to(torch.bfloat16)
    logits[0, 17] = logits[0, 900] = 50.0  # a tie for the top: the first index
    return logits


@pytest.fixture(params=["torch", "native"])
def ops(request: pytest.FixtureRequest) -> Ops:
    """The sampler with each backend's argmax (the native kernel where it builds)."""
    if request.param == "torch":
        return TorchOps()
    if KERNELS is None:
        pytest.skip("no C compiler: the native kernels are not built")
    return native_ops()


def _request(i: int, seed: int = 0, **params: object) -> Request:
    return Request(f"r{i}", "t", [5, 6, 7], SamplingParams(max_tokens=4, **params),  # type: ignore[arg-type]
                   generator=torch.Generator().manual_seed(seed + i))


def test_plain_greedy_rows_read_the_bfloat16_logits_as_they_are(ops: Ops) -> None:
    logits = _logits(6, 1)
    requests = [_request(i, temperature=0) for i in range(6)]
    assert not changes_logits(requests, EOS)
    got = sample(logits, requests, EOS, ops)
    assert [token for token, _ in got] == logits.float().argmax(dim=-1).tolist()
    assert got[0][0] == 17
    assert all(logprobs is None for _, logprobs in got)
    assert got == sample(logits.float(), requests, EOS, ops)


@pytest.mark.parametrize("params", [
    {"temperature": 0, "logprobs": 2},
    {"temperature": 0, "logit_bias": ((901, 80.0),)},
    {"temperature": 0, "min_tokens": 2},
    {"temperature": 0, "presence_penalty": 1.5},
    {"temperature": 0.8, "seed": 7},
])
def test_a_processor_logprobs_or_a_random_row_runs_in_float32(params: dict[str, object], ops: Ops) -> None:
    """One such row among greedy ones: the same tokens (and logprobs) from the bfloat16 logits
    as from their float32 widening, with the same random draws."""
    logits = _logits(4, 2)
    logits[1, EOS[0]] = 60.0  # the EOS token leads row 1: min_tokens must ban it
    make = [lambda: [_request(0, temperature=0), _request(1, **params), _request(2, temperature=0),
                     _request(3, temperature=0)] for _ in range(2)]
    requests_bf16, requests_f32 = make[0](), make[1]()
    got, want = sample(logits, requests_bf16, EOS, ops), sample(logits.float(), requests_f32, EOS, ops)
    assert [token for token, _ in got] == [token for token, _ in want]
    assert [lp for _, lp in got] == [lp for _, lp in want]
    if "logit_bias" in params:
        assert got[1][0] == 901
    if "min_tokens" in params:
        assert got[1][0] != EOS[0]
    if "logprobs" in params:
        assert got[1][1] is not None and len(got[1][1].top) == 2


@pytest.mark.parametrize(("params", "changes"), [
    ({"temperature": 0}, False),
    ({"temperature": 0, "min_tokens": 2, "ignore_eos": True}, False),  # no stop token to ban
    ({"temperature": 0, "min_tokens": 2}, True),
    ({"temperature": 0, "min_tokens": 2, "ignore_eos": True, "stop_token_ids": [9]}, True),
    ({"temperature": 0, "logit_bias": ((4, 1.0),)}, True),
    ({"temperature": 0, "repetition_penalty": 1.2}, True),
    ({"temperature": 0, "frequency_penalty": 0.5}, True),
])
def test_changes_logits_says_whether_the_processors_change_anything(params: dict[str, object],
                                                                     changes: bool) -> None:
    requests = [_request(0, temperature=0), _request(1, **params)]
    logits = _logits(2, 3).float()
    assert changes_logits(requests, EOS) == changes
    processed = apply_logits_processors(logits, requests, EOS)
    assert (processed is not logits) == changes
    if not changes:
        assert torch.equal(processed, logits)
