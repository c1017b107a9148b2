"""Token sampling for a whole batch: logits processors, greedy, temperature, top-k, min-p, top-p.

Everything is tensor arithmetic over [num_requests, vocab] (or one kernel call: `Ops.argmax_rows`,
`Ops.draw_rows`); per-request values (temperature, top_k, top_p, penalties, biases) are gathered
into per-row tensors. The only per-row Python work is drawing each random row's uniform from its
own generator.

Device: the arithmetic runs where the logits are (the engine's device); a random row's draw is
taken on the host from its request's CPU generator and copied over, so a seed gives the same
draws on any device and a generator's state moves with a PD handoff as it is.

Determinism: each request samples with its own `torch.Generator` (seeded from its `seed`, or
from the OS random source when it has none). A random row is chosen by inverting its
cumulative distribution: one uniform u in [0, 1) drawn from the request's generator, and the
first token whose cumulative mass exceeds u times the row's total (`ops/torch_sampling.py`;
`Ops.draw_rows` for rows that ask for temperature alone, in one pass). That samples
exactly from `probs` and consumes one number per row and step whatever the batch holds, so
greedy and seeded outputs are reproducible across batch compositions, preemption and
chunking, up to floating-point differences in the logits themselves (different batch shapes
may sum in a different order: in float32 a seeded draw near a token's edge flips now and then,
in bfloat16 most seeded requests of a different batch shape part within a few tokens; the
README's "Sampling and determinism" has the figures). It replaced the exponential race (argmax
of probs / q with a vocabulary's worth of q ~ Exp(1) per row), whose per-row noise cost
0.8 ms a row on the 49k-token vocabulary of the default model, 26 ms of a c=32 step.

Logprobs are those of the processed logits (after logit_bias, the min_tokens ban and the
penalties), before temperature, top-k, min-p and top-p; each carries the token's rank among all
tokens. Prompt logprobs (`prompt_logprobs`) are those of the raw logits. The filters apply in vLLM's order:
temperature, then min-p and top-k (they commute: neither moves the most likely token), then
top-p over what is left.
"""

from __future__ import annotations

import torch

from kvseal.engine.logits_processors import apply_logits_processors, changes_logits, exhausted_rows
from kvseal.ops import Ops
from kvseal.ops.torch_sampling import draw_from_probs, top_p_filter
from kvseal.types import Request, TokenLogprobs


def sample(logits: torch.Tensor, requests: list[Request], eos_token_ids: tuple[int, ...],
           ops: Ops) -> list[tuple[int | None, TokenLogprobs | None]]:
    """logits: [num_requests, vocab], one row per request that reached its last token, float32
    or the model's bfloat16. A batch with no processor and no logprobs reads the rows as they
    are: `ops.argmax_rows` for greedy rows, `ops.draw_rows` for random ones, both widening each
    value exactly as they read it (the same token as of the float32 widening). Everything else
    runs on the float32 widening. A row whose grammar and `allowed_token_ids` leave no token
    gets (None, None): nothing was sampled, and the caller ends that request."""
    plain = not changes_logits(requests, eos_token_ids) and all(r.params.logprobs is None for r in requests)
    if plain and all(r.params.is_greedy for r in requests):
        return [(token, None) for token in ops.argmax_rows(logits).tolist()]
    if plain:
        return [(token, None) for token in _choose(logits, requests, ops).tolist()]
    logits = apply_logits_processors(logits.float(), requests, eos_token_ids)
    tokens = _choose(logits, requests, ops)
    samples: list[tuple[int | None, TokenLogprobs | None]] = list(zip(tokens.tolist(),
                                                                       _logprobs(logits, tokens, requests)))
    for row in exhausted_rows(logits, requests):
        samples[row] = (None, None)
    return samples


def _choose(logits: torch.Tensor, requests: list[Request], ops: Ops) -> torch.Tensor:
    """[num_requests] int64: argmax for greedy rows; for a random row, a draw from its filtered
    distribution. A row without top-k or min-p is always drawn by `ops.draw_rows` (temperature
    and top-p) and one with either always from its filtered probabilities, whatever else the
    batch holds."""
    device = logits.device
    if all(r.params.is_greedy for r in requests):
        return ops.argmax_rows(logits)
    temperature = torch.tensor([1.0 if r.params.is_greedy else r.params.temperature for r in requests],
                               dtype=torch.float32)
    top_p = torch.tensor([r.params.top_p for r in requests], dtype=torch.float32)
    u = torch.tensor([0.0 if r.params.is_greedy else torch.rand((), dtype=torch.float64, generator=r.generator).item()
                      for r in requests], dtype=torch.float64)
    filtered = {i for i, r in enumerate(requests)
                if not r.params.is_greedy and (r.params.top_k > 0 or r.params.min_p > 0)}
    plain = [i for i, r in enumerate(requests) if not r.params.is_greedy and i not in filtered]
    if len(plain) == len(requests):
        return ops.draw_rows(logits, temperature.to(device), top_p.to(device), u.to(device))
    tokens = ops.argmax_rows(logits)  # the greedy rows' answer; random rows are overwritten
    if plain:
        rows = torch.tensor(plain, device=device)
        tokens[rows] = ops.draw_rows(logits[rows].contiguous(), temperature[plain].to(device),
                                     top_p[plain].to(device), u[plain].to(device))
    if filtered:
        ordered = sorted(filtered)
        rows, chosen = torch.tensor(ordered, device=device), [requests[i] for i in ordered]
        vocab = logits.shape[-1]
        k = [min(r.params.top_k, vocab) if r.params.top_k > 0 else vocab for r in chosen]
        scaled = logits[rows].float() / temperature[ordered].to(device)[:, None]
        cut = [j for j, n in enumerate(k) if n < vocab]
        if len(cut) == len(k):
            scaled = _top_k(scaled, k)
        elif cut:  # rows with min-p alone keep every logit here
            scaled[cut] = _top_k(scaled[cut], [k[j] for j in cut])
        min_p = [r.params.min_p for r in chosen]
        if any(min_p):
            scaled = _min_p(scaled, torch.tensor(min_p, device=device))
        probs = torch.softmax(scaled, dim=-1)
        if bool((top_p[ordered] < 1).any()):
            probs = top_p_filter(probs, top_p[ordered], candidates=max(k))
        tokens[rows] = draw_from_probs(probs, u[ordered])
    return tokens


def _min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the tokens whose probability is at least min_p times the row's largest:
    a logit at least the row's largest plus log(min_p) (min_p 0 keeps every token)."""
    floor = scaled.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]  # log 0 = -inf keeps all
    return scaled.masked_fill(scaled < floor, float("-inf"))


def _top_k(scaled: torch.Tensor, k: list[int]) -> torch.Tensor:
    """Keep, per row, the logits at least as large as the row's k-th largest."""
    top_k = torch.tensor(k, device=scaled.device)
    kth = scaled.topk(max(k), dim=-1).values.gather(1, (top_k - 1)[:, None])  # [B, 1]
    return scaled.masked_fill(scaled < kth, float("-inf"))


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, requests: list[Request]) -> list[TokenLogprobs | None]:
    wanted = [r.params.logprobs for r in requests]
    if all(n is None for n in wanted):
        return [None] * len(requests)
    return _token_logprobs(torch.log_softmax(logits, dim=-1), tokens, wanted)


def _token_logprobs(logprobs: torch.Tensor, tokens: torch.Tensor,
                    wanted: list[int | None]) -> list[TokenLogprobs | None]:
    """Row i: token tokens[i]'s logprob and rank, and the top wanted[i] alternatives (None: no entry)."""
    chosen_t = logprobs.gather(1, tokens[:, None])
    ranks = (logprobs > chosen_t).sum(dim=1).add_(1).tolist()
    chosen = chosen_t[:, 0].tolist()
    max_top = max(n or 0 for n in wanted)
    top = torch.topk(logprobs, max_top) if max_top > 0 else None
    top_ids = top.indices.tolist() if top is not None else []
    top_values = top.values.tolist() if top is not None else []
    results: list[TokenLogprobs | None] = []
    for row, num_top in enumerate(wanted):
        if num_top is None:
            results.append(None)
            continue
        pairs = () if num_top == 0 else tuple(zip(top_ids[row][:num_top], top_values[row][:num_top]))
        results.append(TokenLogprobs(int(tokens[row]), chosen[row], pairs, ranks[row]))
    return results


PROMPT_LOGPROBS_ROWS = 256  # rows widened to float32 at once: a [256, vocab] slice, not the whole chunk's


def prompt_logprobs_of(logits: torch.Tensor, token_ids: list[int], num_top: int) -> list[TokenLogprobs]:
    """logits: [len(token_ids), vocab], row i the model's raw logits for the position before
    token_ids[i]. Each token's logprob and rank and the top `num_top` alternatives, worked out
    a slice of rows at a time."""
    results: list[TokenLogprobs] = []
    for first in range(0, len(token_ids), PROMPT_LOGPROBS_ROWS):
        rows = logits[first:first + PROMPT_LOGPROBS_ROWS]
        ids = torch.tensor(token_ids[first:first + PROMPT_LOGPROBS_ROWS], device=logits.device)
        logprobs = torch.log_softmax(rows.float(), dim=-1)
        results += [lp for lp in _token_logprobs(logprobs, ids, [num_top] * len(ids)) if lp is not None]
    return results
