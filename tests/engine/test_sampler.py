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


def test_a_random_row_is_drawn_from_its_distribution_and_never_from_zero_mass() -> None:
    """The inverse-CDF draw (blocks, then the token inside one) against the probabilities: three
    rows over a vocabulary that is not a whole number of blocks, with tokens of zero mass (as top-k
    or top-p leave them), including whole zero blocks and the last token of the vocabulary."""
    from kvseal.engine.sampler import DRAW_BLOCK, _draw

    vocab = 3 * DRAW_BLOCK + 37
    probs = torch.zeros(3, vocab)
    probs[0, [0, DRAW_BLOCK - 1, DRAW_BLOCK, DRAW_BLOCK + 1, vocab - 2, vocab - 1]] = torch.tensor(
        [0.1, 0.2, 0.15, 0.15, 0.25, 0.15])
    probs[1, 2 * DRAW_BLOCK + 5:2 * DRAW_BLOCK + 9] = torch.tensor([2.0, 0.0, 1.0, 1.0])  # unnormalized
    probs[2] = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(3)), dim=-1)
    probs[2, ::2] = 0.0
    draws = 20_000
    requests = [_request(i, seed=7, temperature=1.0) for i in range(3)]
    counts = torch.zeros(3, vocab)
    for _ in range(draws):
        counts[torch.arange(3), _draw(probs, requests)] += 1
    assert not (counts[probs == 0] > 0).any(), "a token of zero mass was drawn"
    expected = probs / probs.sum(dim=-1, keepdim=True)
    frequencies = counts / draws
    for row in (0, 1):  # few tokens: each one's frequency within 5 standard errors
        support = expected[row] > 0
        sd = (expected[row][support] * (1 - expected[row][support]) / draws).sqrt()
        assert ((frequencies[row][support] - expected[row][support]).abs() < 5 * sd).all()
    # many small tokens: the mass drawn from each half block matches the half block's mass
    halves = torch.nn.functional.pad(torch.stack([frequencies[2], expected[2]]), (0, 4 * DRAW_BLOCK - vocab))
    by_half = halves.view(2, 8, DRAW_BLOCK // 2).sum(dim=-1)
    assert (by_half[0] - by_half[1]).abs().max() < 0.02


def test_a_row_draws_one_number_per_step_whatever_the_batch_holds() -> None:
    """A seeded row's token depends on its own generator only: alone, or beside greedy and other
    random rows, it draws the same token, and its generator advanced by one draw either way."""
    from kvseal.engine.sampler import _draw

    probs = torch.softmax(torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5)), dim=-1)
    alone = _request(0, seed=11, temperature=1.0)
    beside = [_request(9, temperature=0.0), _request(0, seed=11, temperature=1.0), _request(4, temperature=1.0),
              _request(5, temperature=0.0)]
    token_alone = _draw(probs[1:2], [alone])[0]
    token_beside = _draw(probs, beside)[1]
    assert token_alone == token_beside
    assert alone.generator is not None and beside[1].generator is not None
    assert torch.equal(alone.generator.get_state(), beside[1].generator.get_state())
