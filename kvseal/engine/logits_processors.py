"""Per-request changes to the logits before sampling, applied to the whole batch at once.

Order (vLLM's): grammar mask, `allowed_token_ids` (every other token masked), logit_bias, the
min_tokens ban on stop tokens (lifted from a row whose grammar or allowed set leaves nothing
but the end: the restriction wins), then the penalties:
repetition (prompt and output tokens, as transformers' and vLLM's `repetition_penalty`: a
positive logit is divided by it, a negative one multiplied),
frequency (minus `frequency_penalty` x the token's count in the output) and presence (minus
`presence_penalty` once the token appears in the output), OpenAI's definitions.

Every step builds a few [num_requests, vocab] tensors with one scatter each; nothing loops
over the vocabulary or does tensor arithmetic per row in Python. A batch whose requests ask
for none of these features is returned unchanged (no copy).

A grammar can leave a row no token at all: with `allowed_token_ids` (sets that share none, at
any step), or alone where the vocabulary cannot spell what it requires next (a tokenizer
without byte tokens); `exhausted_rows` finds those rows, checking only rows with a grammar, so
the sampler never picks a token the grammar or the allowed set refuses.
"""

from __future__ import annotations

import torch

from kvseal.structured.matching import apply_grammar_masks
from kvseal.types import Request


def changes_logits(requests: list[Request], eos_token_ids: tuple[int, ...]) -> bool:
    """Whether any request asks for a processor. When none does, `apply_logits_processors`
    returns its input as it is (and the sampler may skip it)."""
    return any(r.grammar is not None or r.params.logit_bias or r.params.has_penalties
               or r.params.allowed_token_ids is not None or _banned_stop_tokens(r, eos_token_ids) for r in requests)


def apply_logits_processors(logits: torch.Tensor, requests: list[Request],
                            eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """logits: [num_requests, vocab] float32. Returns the processed logits (a new tensor if changed)."""
    if not changes_logits(requests, eos_token_ids):
        return logits
    logits = apply_grammar_masks(logits, requests)
    logits = _keep_allowed_tokens(logits, requests)
    logits = _add_logit_bias(logits, requests)
    logits = _ban_early_stop_tokens(logits, requests, eos_token_ids)
    return apply_penalties(logits, requests)


def exhausted_rows(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    """The rows of the processed `logits` with no token left: every one -inf. Only a row with a
    constraining grammar can get there (logit_bias is finite, the min_tokens ban is lifted from
    a row it would empty, and `allowed_token_ids` is never empty), so only those rows are read:
    a batch without one costs nothing and no host sync (a grammar row syncs each step anyway,
    for its matcher to take the sampled token)."""
    rows = [row for row, r in enumerate(requests) if r.grammar is not None and r.grammar.constrains]
    if not rows:
        return []
    index = torch.tensor(rows, device=logits.device)
    empty = torch.isneginf(logits[index]).all(dim=-1).tolist()
    return [row for row, is_empty in zip(rows, empty) if is_empty]


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    if not any(r.params.has_penalties for r in requests):
        return logits
    vocab_size = logits.shape[-1]
    device = logits.device
    output_counts = token_counts([r.output_token_ids for r in requests], vocab_size, device)  # [B, V]
    logits = logits.clone()
    repetition = torch.tensor([r.params.repetition_penalty for r in requests], dtype=logits.dtype, device=device)
    if any(r.params.repetition_penalty != 1 for r in requests):
        seen = (token_counts([r.prompt_token_ids for r in requests], vocab_size, device) > 0) | (output_counts > 0)
        penalty = torch.where(seen, repetition[:, None], torch.ones_like(logits))
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    frequency = torch.tensor([r.params.frequency_penalty for r in requests], dtype=logits.dtype, device=device)
    presence = torch.tensor([r.params.presence_penalty for r in requests], dtype=logits.dtype, device=device)
    logits -= frequency[:, None] * output_counts
    logits -= presence[:, None] * (output_counts > 0).to(logits.dtype)
    return logits


def token_counts(sequences: list[list[int]], vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(sequences), vocab_size] float32 on `device`: how often each token occurs in each sequence."""
    max_len = max((len(s) for s in sequences), default=0)
    padded = torch.full((len(sequences), max_len), vocab_size, dtype=torch.int64)  # vocab_size: padding column
    for row, seq in enumerate(sequences):
        if seq:
            padded[row, :len(seq)] = torch.tensor(seq, dtype=torch.int64)
    padded = padded.to(device, non_blocking=True)
    counts = torch.zeros(len(sequences), vocab_size + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab_size]


def _keep_allowed_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """-inf for every token outside a row's `allowed_token_ids` (rows without one unchanged)."""
    rows: list[int] = []
    tokens: list[int] = []
    for row, request in enumerate(requests):
        allowed = request.params.allowed_token_ids
        if allowed is not None:
            rows.extend([row] * len(allowed))
            tokens.extend(allowed)
    if not rows:
        return logits
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device)] = True
    restricted = torch.tensor([r.params.allowed_token_ids is not None for r in requests], device=logits.device)
    return logits.masked_fill(restricted[:, None] & ~keep, float("-inf"))


def _add_logit_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    rows, tokens, biases = [], [], []
    for row, request in enumerate(requests):
        for token, bias in request.params.logit_bias:
            rows.append(row)
            tokens.append(token)
            biases.append(bias)
    if not rows:
        return logits
    index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
    return logits.index_put(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)


def _ban_early_stop_tokens(logits: torch.Tensor, requests: list[Request],
                           eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """min_tokens: stop tokens cannot be sampled before that many tokens were produced, while
    anything else can. The grammar wins: a row whose grammar (already applied to `logits`)
    allows nothing but the banned tokens keeps them, so a complete answer ends the request
    (stop) before min_tokens instead of leaving no token to sample."""
    rows, tokens = [], []
    for row, request in enumerate(requests):
        banned = _banned_stop_tokens(request, eos_token_ids)
        rows.extend([row] * len(banned))
        tokens.extend(banned)
    if not rows:
        return logits
    index = (torch.tensor(rows, device=logits.device), torch.tensor(tokens, device=logits.device))
    banned_logits = logits.index_put(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))
    return _unban_where_only_the_end_is_left(logits, banned_logits, requests)


def _unban_where_only_the_end_is_left(logits: torch.Tensor, banned_logits: torch.Tensor,
                                      requests: list[Request]) -> torch.Tensor:
    """logits, banned_logits: [num_requests, vocab], before and after the ban. A row with a
    grammar or allowed set that the ban left without any token takes its row from `logits`;
    every other row (all rows without a restriction) is `banned_logits`' as it is. No host sync."""
    restricted = [(r.grammar is not None and r.grammar.constrains) or r.params.allowed_token_ids is not None
                  for r in requests]
    if not any(restricted):
        return banned_logits
    restricted_rows = torch.tensor(restricted, device=logits.device)  # [num_requests] bool
    emptied = torch.isneginf(banned_logits).all(dim=-1) & restricted_rows  # [num_requests] bool
    return torch.where(emptied[:, None], logits, banned_logits)


def _banned_stop_tokens(request: Request, eos_token_ids: tuple[int, ...]) -> list[int]:
    """The stop tokens this request may not sample yet (min_tokens not reached), else none."""
    params = request.params
    if request.num_output_tokens >= params.min_tokens:
        return []
    return list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))
