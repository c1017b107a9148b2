"""The sampler on the model's own logits dtype: a batch of plain greedy rows takes the argmax of
the bfloat16 rows as they are, and anything else (a processor, logprobs, a random row) runs on
their float32 widening. Either way the tokens are those of the float32 logits."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from built_kernels import KERNELS, native_ops

from kvseal import SamplingParams
from kvseal.engine.logits_processors import apply_logits_processors, changes_logits
from kvseal.engine.sampler import sample
from kvseal.ops import Ops, TorchOps
from kvseal.ops.torch_sampling import DRAW_BLOCK, draw_from_probs
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



class _Allows:
    """A grammar that allows exactly `tokens` next (xgrammar's bitmask layout: bit j of word w
    is token 32 w + j)."""

    constrains = True  # (a `RequestGrammar` outside a reasoning block)

    def __init__(self, *tokens: int) -> None:
        self.tokens = tokens

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for token in self.tokens:
            bitmask[row, token // 32] |= 1 << (token % 32)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_min_tokens_ban_yields_to_a_grammar_that_allows_only_the_end(temperature: float, ops: Ops) -> None:
    """The grammar wins: a row whose grammar allows nothing but stop tokens samples one of them
    before min_tokens (its answer is complete, the request ends) instead of a token the grammar
    refuses; a row whose grammar allows anything else, and a row without a grammar, keep the ban."""
    logits = _logits(3, 4).float()
    logits[:, EOS[0]] = 60.0  # the end leads every row
    requests = [_request(i, seed=5, temperature=temperature, min_tokens=2, stop_token_ids=[9]) for i in range(3)]
    requests[0].grammar = _Allows(EOS[0], 9)  # a complete answer: only the end is left
    requests[1].grammar = _Allows(EOS[0], 9, 42)  # the end, or one more token
    tokens = [token for token, _ in sample(logits, requests, EOS, ops)]
    assert tokens[0] == EOS[0]
    assert tokens[1] == 42
    assert tokens[2] not in (EOS[0], 9)


Drawer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (probs, u) -> tokens


@pytest.fixture(params=["probs", "torch", "native"])
def drawer(request: pytest.FixtureRequest) -> Drawer:
    """The three ways a random row is drawn: from filtered probabilities (top-k/top-p rows), and
    from logits at temperature 1 by each backend's `draw_rows` (a zero probability is a -inf logit)."""
    if request.param == "probs":
        return draw_from_probs
    ops: Ops = TorchOps() if request.param == "torch" else _native_or_skip()
    return lambda probs, u: ops.draw_rows(probs.log(), torch.ones(probs.shape[0]), torch.ones(probs.shape[0]), u)


def _native_or_skip() -> Ops:
    if KERNELS is None:
        pytest.skip("no C compiler: the native kernels are not built")
    return native_ops()


def test_a_random_row_is_drawn_from_its_distribution_and_never_from_zero_mass(drawer: Drawer) -> None:
    """Inverse-CDF draws (blocks, then the token inside one) against the probabilities: three
    rows over a vocabulary that is not a whole number of blocks, with tokens of zero mass (as
    top-k, top-p or a grammar mask leave them), whole zero blocks and the vocabulary's last token."""
    vocab = 3 * DRAW_BLOCK + 37
    probs = torch.zeros(3, vocab)
    probs[0, [0, DRAW_BLOCK - 1, DRAW_BLOCK, DRAW_BLOCK + 1, vocab - 2, vocab - 1]] = torch.tensor(
        [0.1, 0.2, 0.15, 0.15, 0.25, 0.15])
    probs[1, 2 * DRAW_BLOCK + 5:2 * DRAW_BLOCK + 9] = torch.tensor([0.5, 0.0, 0.25, 0.25])
    probs[2] = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(3)), dim=-1)
    probs[2, ::2] = 0.0
    probs[2] /= probs[2].sum()
    rounds, per_round = 10, 2000
    generator = torch.Generator().manual_seed(7)
    counts = torch.zeros(3, vocab)
    for _ in range(rounds):  # per_round copies of the three rows in one batch
        tokens = drawer(probs.repeat(per_round, 1), torch.rand(3 * per_round, dtype=torch.float64,
                                                                 generator=generator)).view(per_round, 3)
        for row in range(3):
            counts[row] += torch.bincount(tokens[:, row], minlength=vocab)
    draws = rounds * per_round
    assert not (counts[probs == 0] > 0).any(), "a token of zero mass was drawn"
    frequencies = counts / draws
    for row in (0, 1):  # few tokens: each one's frequency within 5 standard errors
        support = probs[row] > 0
        sd = (probs[row][support] * (1 - probs[row][support]) / draws).sqrt()
        assert ((frequencies[row][support] - probs[row][support]).abs() < 5 * sd).all()
    # many small tokens: the mass drawn from each half block matches the half block's mass
    halves = torch.nn.functional.pad(torch.stack([frequencies[2], probs[2]]), (0, 4 * DRAW_BLOCK - vocab))
    by_half = halves.view(2, 8, DRAW_BLOCK // 2).sum(dim=-1)
    assert (by_half[0] - by_half[1]).abs().max() < 0.02


def test_the_native_draw_agrees_with_torchs_and_reads_bfloat16_as_its_widening() -> None:
    """The kernel's one pass and torch's softmax-then-search pick the same token for the same u
    (they may differ only where u falls within float rounding of a boundary), at temperatures
    other than 1; bfloat16 logits draw what their exact float32 widening draws; a row with a NaN
    takes torch's path and gets torch's answer."""
    native = _native_or_skip()
    generator = torch.Generator().manual_seed(11)
    logits = (torch.randn(64, 5000, generator=generator) * 3).to(torch.bfloat16)
    temperature = torch.rand(64, generator=generator) + 0.3
    top_p = torch.where(torch.arange(64) % 2 == 0, 1.0, torch.rand(64, generator=generator) * 0.9 + 0.05)
    untied = torch.randn(64, 5000, generator=generator) * 3  # bfloat16 ties make a nucleus's edge ambiguous
    same = same_top_p = 0
    for _ in range(20):
        u = torch.rand(64, dtype=torch.float64, generator=generator)
        expected = TorchOps().draw_rows(logits.float(), temperature, torch.ones(64), u)
        drawn = native.draw_rows(logits.float(), temperature, torch.ones(64), u)
        assert torch.equal(native.draw_rows(logits, temperature, torch.ones(64), u), drawn)
        same += int((drawn == expected).sum())
        same_top_p += int((native.draw_rows(untied, temperature, top_p, u) ==
                           TorchOps().draw_rows(untied, temperature, top_p, u)).sum())
    assert same >= 0.999 * 20 * 64
    assert same_top_p >= 0.99 * 20 * 64
    with_nan = logits.float()
    with_nan[5, 17] = float("nan")
    u = torch.rand(64, dtype=torch.float64, generator=generator)
    assert torch.equal(native.draw_rows(with_nan, temperature, top_p, u),
                       TorchOps().draw_rows(with_nan, temperature, top_p, u))


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_top_p_keeps_the_heaviest_tokens_up_to_the_mass_and_draws_only_them(backend: str) -> None:
    """The nucleus: tokens kept while the heavier ones hold less than top_p of the mass (so the
    token that crosses it is kept), at least the heaviest one however small top_p is; nothing
    outside it is ever drawn, and inside it the draws follow the renormalized weights. Weights
    chosen so the nucleus boundary falls inside one histogram bucket of the kernel (0.30 and 0.29)."""
    ops: Ops = TorchOps() if backend == "torch" else _native_or_skip()
    weights = torch.zeros(4 * DRAW_BLOCK)
    weights[[7, 900, 901, 1500, 2000]] = torch.tensor([0.30, 0.29, 0.20, 0.11, 0.10])
    logits = weights.log()[None].repeat(20_000, 1)
    ones = torch.ones(20_000)
    u = torch.rand(20_000, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    cases = {0.5: {7: 0.30, 900: 0.29}, 0.6: {7: 0.30, 900: 0.29, 901: 0.20}, 1e-6: {7: 1.0}}
    for top_p, kept in cases.items():
        counts = torch.bincount(ops.draw_rows(logits, ones, ones * top_p, u), minlength=logits.shape[1])
        assert set(counts.nonzero().flatten().tolist()) == set(kept), top_p
        total = sum(kept.values())
        for token, weight in kept.items():
            share = weight / total
            assert abs(counts[token].item() / 20_000 - share) < 5 * (share * (1 - share) / 20_000) ** 0.5 + 1e-9


def test_min_p_drops_the_tokens_below_its_share_of_the_heaviest_and_draws_the_rest_by_weight(ops: Ops) -> None:
    """vLLM's min_p: a token stays while its probability is at least min_p times the most likely
    one's (0.40 x 0.5 = 0.20: 0.25 and 0.20 stay, 0.19 and 0.16 go); nothing dropped is ever
    drawn and the rest follow their renormalized weights. With top-p after it, the nucleus is
    taken from what min-p kept (0.5 of 0.85: the first two)."""
    weights = torch.zeros(VOCAB)
    weights[[7, 300, 301, 650, 900]] = torch.tensor([0.40, 0.25, 0.20, 0.19, 0.16]) / 1.20
    num_rows = 4000
    logits = weights.log()[None].repeat(num_rows, 1)
    cases = {(0.5, 1.0): {7: 0.40, 300: 0.25, 301: 0.20}, (0.5, 0.5): {7: 0.40, 300: 0.25}, (1.0, 1.0): {7: 1.0}}
    for (min_p, top_p), kept in cases.items():
        requests = [_request(i, seed=100, temperature=1.0, min_p=min_p, top_p=top_p) for i in range(num_rows)]
        counts = torch.bincount(torch.tensor([token for token, _ in sample(logits, requests, EOS, ops)]),
                                minlength=VOCAB)
        assert set(counts.nonzero().flatten().tolist()) == set(kept), (min_p, top_p)
        total = sum(kept.values())
        for token, weight in kept.items():
            share = weight / total
            assert abs(counts[token].item() / num_rows - share) < 5 * (share * (1 - share) / num_rows) ** 0.5 + 1e-9


def test_min_p_zero_and_rows_beside_a_min_p_row_sample_as_without_it(ops: Ops) -> None:
    """min_p 0 is off: the same tokens as without the field (the plain draw). A top-k row and a
    temperature-only row draw the same tokens beside a min-p row as alone (a min-p row alone in
    the batch leaves the others' filters as they were)."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    for step in range(5):
        plain = [_request(0, seed=step, temperature=0.9), _request(1, seed=step, temperature=0.7, top_k=12)]
        zero = [_request(0, seed=step, temperature=0.9, min_p=0.0), _request(1, seed=step, temperature=0.7, top_k=12)]
        beside = [_request(0, seed=step, temperature=0.9), _request(1, seed=step, temperature=0.7, top_k=12),
                  _request(2, seed=step, temperature=1.0, min_p=0.3)]
        alone = [token for token, _ in sample(logits[:2], plain, EOS, ops)]
        assert [token for token, _ in sample(logits[:2], zero, EOS, ops)] == alone
        assert [token for token, _ in sample(logits, beside, EOS, ops)][:2] == alone


def test_a_row_draws_one_number_per_step_whatever_the_batch_holds(ops: Ops) -> None:
    """A seeded row's token depends on its own generator only: alone, or beside greedy rows, rows
    with top-k or top-p and other random rows, it samples the same token, and its generator has
    advanced by one draw either way."""
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    alone = _request(0, seed=11, temperature=0.8)
    beside = [_request(9, temperature=0.0), _request(0, seed=11, temperature=0.8), _request(4, temperature=1.0),
              _request(5, temperature=0.0), _request(6, temperature=1.0, top_p=0.9)]
    token_alone = sample(logits[1:2], [alone], EOS, ops)[0][0]
    assert sample(logits, beside[:4], EOS, ops)[1][0] == token_alone  # temperature alone: `draw_rows`
    again = _request(0, seed=11, temperature=0.8)
    beside[1] = again
    assert sample(logits, beside, EOS, ops)[1][0] == token_alone  # beside a top-p row
    assert alone.generator is not None and again.generator is not None
    assert torch.equal(alone.generator.get_state(), again.generator.get_state())


@pytest.mark.parametrize("kind", [{}, {"top_p": 0.5}, {"top_k": 5}, {"min_p": 0.5}])
def test_a_random_row_with_no_distribution_still_gets_a_token_of_the_vocabulary(ops: Ops,
                                                                               kind: dict[str, object]) -> None:
    """Every logit -inf (all banned), a NaN, or +inf logits (a repetition_penalty that rounds to
    0 divides by it): nothing to invert, and the row answers as torch's argmax does on its softmax
    (token 0 here), never an index outside the vocabulary (which would stop the engine when it
    detokenizes), beside a row that samples as usual."""
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(9))
    logits[0] = float("-inf")
    logits[1, 7] = float("nan")
    logits[2, [5, 9]] = float("inf")
    requests = [_request(i, seed=3, temperature=1.0, **kind) for i in range(4)]
    tokens = [token for token, _ in sample(logits, requests, EOS, ops)]
    assert tokens[:3] == [0, 0, 0]
    assert 0 <= tokens[3] < VOCAB
