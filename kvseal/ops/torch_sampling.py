"""The sampler's random draw in torch: inverse-CDF sampling of each row, in two levels.

One uniform u in [0, 1) per row (the caller draws it from the request's own generator), and the
first token whose cumulative mass exceeds u times the row's total. A full-vocabulary float64
cumsum costs ~3 ms on a 32-row step of a 49,152-token vocabulary; in two levels, the block of
DRAW_BLOCK tokens where the target falls (blocks summed in float32, pairwise, then accumulated in
float64), then the token inside it (float64), it is ~1 ms. The draw is exact up to the float32
rounding the probabilities themselves carry. `csrc/sample.c` draws by the same rule in one pass
over the logits, for rows without top-k or top-p.
"""

from __future__ import annotations

import torch

DRAW_BLOCK = 512  # tokens summed together in a draw's first level


def draw_from_probs(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs [rows, vocab] (unnormalized is fine), u [rows] float64 in [0, 1) -> [rows] int64.

    Comparisons are strict ("exceeds"), so a token or block of zero mass (cut by top-k or top-p)
    is never chosen; should rounding leave the target at or past the block's own total, the
    block's last token of nonzero mass is taken. A row whose mass is not a positive number (all
    zero, or NaN) takes its argmax, as torch answers it."""
    rows, vocab = probs.shape
    num_blocks = -(-vocab // DRAW_BLOCK)
    if num_blocks * DRAW_BLOCK != vocab:
        probs = torch.nn.functional.pad(probs, (0, num_blocks * DRAW_BLOCK - vocab))
    blocks = probs.view(rows, num_blocks, DRAW_BLOCK)
    block_cumulative = blocks.sum(dim=-1).to(torch.float64).cumsum(dim=-1)  # [rows, num_blocks]
    targets = u.to(probs.device, torch.float64, non_blocking=True) * block_cumulative[:, -1]
    chosen = torch.searchsorted(block_cumulative, targets[:, None], right=True)[:, 0].clamp_(max=num_blocks - 1)
    row_index = torch.arange(rows, device=probs.device)
    before = torch.where(chosen > 0, block_cumulative[row_index, (chosen - 1).clamp(min=0)], 0.0)
    block = blocks[row_index, chosen]  # [rows, DRAW_BLOCK]
    inner = torch.searchsorted(block.to(torch.float64).cumsum(dim=-1), (targets - before)[:, None], right=True)[:, 0]
    last = torch.where(block > 0, torch.arange(DRAW_BLOCK, device=probs.device), -1).amax(dim=-1)
    drawn = chosen * DRAW_BLOCK + torch.minimum(inner, last)
    total = block_cumulative[:, -1]
    valid = torch.isfinite(total) & (total > 0)
    if bool(valid.all()):
        return drawn
    # a row with no distribution (every logit -inf, or a NaN: nothing to invert) answers as
    # torch.argmax does, the first NaN or else token 0, never an index outside the vocabulary
    return torch.where(valid, drawn, probs[:, :vocab].argmax(dim=-1))


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor, candidates: int | None = None) -> torch.Tensor:
    """Per row, keep the smallest set of most likely tokens whose mass reaches top_p [rows] (at
    least one); the rest become 0. Not renormalized: a draw scales by its row's total. With
    `candidates` (top-k rows: no row has more nonzero tokens), only that many are sorted."""
    if candidates is not None and candidates < probs.shape[-1]:
        sorted_probs, order = probs.topk(candidates, dim=-1)
    else:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= top_p.to(probs.device, probs.dtype)[:, None]
    drop[:, 0] = False  # the most likely token always stays, however small top_p is
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def draw_rows(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab], temperature [rows] (> 0), top_p [rows] (1: no cut), u [rows] float64
    -> [rows] int64: a draw from each row's softmax(logits / temperature), cut to its top-p nucleus."""
    scaled = logits.float() / temperature.to(logits.device, torch.float32)[:, None]
    probs = torch.softmax(scaled, dim=-1)
    if bool((top_p < 1).any()):
        probs = top_p_filter(probs, top_p)
    return draw_from_probs(probs, u)
