"""Token sampling: greedy, temperature, top-k, top-p, per-request generators.

Determinism: each request samples with its own `torch.Generator` (seeded from its `seed`, or
from the OS random source when it has none), so its random draws do not depend on what it is
batched with. Greedy and seeded outputs are therefore reproducible across batch
compositions, preemption and chunking, up to floating-point differences in the logits
themselves (different batch shapes may sum in a different order; on CPU in float32 we have
not seen a token flip in the tests, but a near-tie can in principle break either way).
"""

from __future__ import annotations

import torch

from kvseal.types import Request, SamplingParams, TokenLogprobs


def sample(logits: torch.Tensor, requests: list[Request],
           eos_token_ids: tuple[int, ...]) -> list[tuple[int, TokenLogprobs | None]]:
    """logits: [num_requests, vocab] float32, one row per request that reached its last token."""
    results = []
    for row, request in zip(logits, requests):
        params = request.params
        row = _ban_early_stop_tokens(row, request, eos_token_ids)
        token = int(row.argmax()) if params.is_greedy else _draw(row, params, request.generator)
        results.append((token, _logprobs(row, token, params.logprobs)))
    return results


def _ban_early_stop_tokens(row: torch.Tensor, request: Request, eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """min_tokens: stop tokens cannot be sampled before that many tokens were produced."""
    params = request.params
    if request.num_output_tokens >= params.min_tokens:
        return row
    banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
    if not banned:
        return row
    row = row.clone()
    row[torch.tensor(banned, dtype=torch.int64)] = float("-inf")
    return row


def _draw(row: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    scaled = row / params.temperature
    if params.top_k > 0:
        kth = torch.topk(scaled, min(params.top_k, scaled.shape[-1])).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    sorted_probs, order = probs.sort(descending=True)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop = mass_before >= top_p
    drop[0] = False  # the most likely token always stays, however small top_p is
    sorted_probs[drop] = 0.0
    kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return kept / kept.sum()


def _logprobs(row: torch.Tensor, token: int, num_top: int | None) -> TokenLogprobs | None:
    if num_top is None:
        return None
    logprobs = torch.log_softmax(row, dim=-1)
    top = torch.topk(logprobs, num_top) if num_top > 0 else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
    return TokenLogprobs(token, float(logprobs[token]), pairs)
