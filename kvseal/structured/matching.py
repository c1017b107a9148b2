"""Per-request grammar state during generation: mask the logits, advance on each token.

A request with `params.structured` carries a `RequestGrammar` in `request.grammar`: an xgrammar
`GrammarMatcher`, and where the request asks for it (`StructuredOutput.reasoning`), the
reasoning block the grammar waits for. Before sampling, every row of the batch whose grammar
constrains it gets its allowed-token bitmask applied (one bitmask tensor for the batch, one
in-place kernel call); after sampling, the token is fed to the grammar. The request finishes
(stop) once the grammar has terminated, i.e. the JSON is complete and a stop token was accepted.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from kvseal.types import ReasoningGate, Request


class Phase(enum.Enum):
    OPENING = "opening"  # the first token: the reasoning block's start, or the answer's first token
    REASONING = "reasoning"  # inside the block: nothing masked, nothing fed to the matcher
    ANSWER = "answer"  # the grammar constrains every token


class RequestGrammar:
    """One request's grammar: its matcher, behind the reasoning block when there is a gate."""

    def __init__(self, matcher: Any, gate: ReasoningGate | None = None) -> None:
        self.matcher = matcher
        self._gate = gate
        self.phase = Phase.ANSWER if gate is None else Phase.REASONING if gate.open_at_start else Phase.OPENING

    @property
    def constrains(self) -> bool:
        """Whether the next token is masked (not while the reasoning block is open)."""
        return self.phase is not Phase.REASONING

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of xgrammar's bitmask [B, ceil(V / 32)] int32: the tokens allowed next."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.phase is Phase.OPENING:
            assert self._gate is not None
            word, bit = divmod(self._gate.start_token_id, 32)
            bitmask[row, word] |= (1 << bit) if bit < 31 else -(1 << 31)  # int32: bit 31 is the sign

    def accept_token(self, token: int) -> bool:
        """Advance; False if the grammar refused the token."""
        gate = self._gate
        if self.phase is Phase.REASONING:
            assert gate is not None
            if token == gate.end_token_id:
                self.phase = Phase.ANSWER
            return True
        if self.phase is Phase.OPENING:
            assert gate is not None
            if token == gate.start_token_id:
                self.phase = Phase.REASONING
                return True
            self.phase = Phase.ANSWER
        return bool(self.matcher.accept_token(token))

    def is_terminated(self) -> bool:
        return self.phase is Phase.ANSWER and bool(self.matcher.is_terminated())


def new_matcher(compiled_grammar: Any, gate: ReasoningGate | None = None) -> RequestGrammar:
    import xgrammar

    return RequestGrammar(xgrammar.GrammarMatcher(compiled_grammar), gate)


def apply_grammar_masks(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """logits: [num_requests, vocab]. Tokens a row's grammar forbids get -inf (a new tensor if any)."""
    rows = [row for row, r in enumerate(requests) if r.grammar is not None and r.grammar.constrains]
    if not rows:
        return logits
    import xgrammar

    bitmask = xgrammar.allocate_token_bitmask(len(requests), logits.shape[-1])  # [B, ceil(V / 32)] int32
    for row in rows:
        requests[row].grammar.fill_next_token_bitmask(bitmask, row)
    logits = logits.clone()
    if logits.device.type == "cpu":
        xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
        return logits
    return _apply_bitmask(logits, bitmask.to(logits.device, non_blocking=True), rows)


def grammar_allows_a_token(request: Request, vocab_size: int) -> bool:
    """Whether the request's grammar alone leaves any of the first `vocab_size` tokens next (its
    mask as `apply_grammar_masks` built it this step: the matcher has not moved since). Read only
    when a row was left with no token, to say which constraint emptied it."""
    import xgrammar

    assert request.grammar is not None
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)
    request.grammar.fill_next_token_bitmask(bitmask, 0)
    return bool(_allowed_tokens(bitmask, vocab_size).any())


def _allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's bitmask [B, ceil(V / 32)] int32 (bit j of word w: token 32 w + j allowed) as a
    [B, vocab_size] bool tensor, on the bitmask's device."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask[:, :, None] >> bits) & 1).bool().reshape(bitmask.shape[0], -1)[:, :vocab_size]


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """xgrammar's bitmask as torch ops on logits' device: forbidden tokens of `rows` get -inf."""
    allowed = _allowed_tokens(bitmask, logits.shape[-1])
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed[index], float("-inf"))
    return logits


def accept_token(request: Request, token: int) -> bool:
    """Advance the request's grammar. Returns False if the grammar refused the token."""
    return bool(request.grammar.accept_token(token))


def is_complete(request: Request) -> bool:
    return bool(request.grammar.is_terminated())
