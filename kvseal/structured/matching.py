"""Per-request grammar state during generation: mask the logits, advance on each token.

A request with `params.structured` carries an xgrammar `GrammarMatcher` in `request.grammar`.
Before sampling, every such row of the batch gets its allowed-token bitmask applied (one
bitmask tensor for the batch, one in-place kernel call); after sampling, the token is fed to
the matcher. The request finishes (stop) once the grammar has terminated, i.e. the JSON is
complete and a stop token was accepted.
"""

from __future__ import annotations

from typing import Any

import torch

from kvseal.types import Request


def new_matcher(compiled_grammar: Any) -> Any:
    import xgrammar

    return xgrammar.GrammarMatcher(compiled_grammar)


def apply_grammar_masks(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """logits: [num_requests, vocab]. Tokens a row's grammar forbids get -inf (a new tensor if any)."""
    rows = [row for row, r in enumerate(requests) if r.grammar is not None]
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


def _apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """xgrammar's bitmask [B, ceil(V / 32)] int32 (bit j of word w: token 32 w + j allowed) as
    torch ops on logits' device: forbidden tokens of `rows` get -inf."""
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool().reshape(bitmask.shape[0], -1)[:, :logits.shape[-1]]
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed[index], float("-inf"))
    return logits


def accept_token(request: Request, token: int) -> bool:
    """Advance the request's grammar. Returns False if the grammar refused the token."""
    return bool(request.grammar.accept_token(token))


def is_complete(request: Request) -> bool:
    return bool(request.grammar.is_terminated())
