"""Turn a scheduler's chunks into the model runner's `ForwardBatch`, and check it first.

`check_forward` runs before every forward, in every configuration: each sequence may read
and write only pages it owns (I3), and every position it attends to must be written, in every
layer, by it, earlier in this ownership period or by this very forward (I4). Checked mode adds
the per-slot verification. A sequence that fails is refused; the rest of the batch may run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvseal._testing.faults import Fault, is_active
from kvseal.errors import IsolationViolation
from kvseal.kvcache.manager import KVCacheManager
from kvseal.kvcache.records import ForwardWrites
from kvseal.types import ForwardBatch, Request, ScheduledChunk


@dataclass(frozen=True)
class PromptRows:
    """Logits rows [first_row, first_row + num_rows) of a forward predict prompt tokens
    [first_token, first_token + num_rows) of `request` (its `prompt_logprobs`)."""

    request: Request
    first_row: int
    first_token: int
    num_rows: int


@dataclass(frozen=True)
class PreparedForward:
    """A batch and what it will write (the write records advance as the forward runs).

    With requests that want prompt logprobs, the forward's logits hold their prompt rows
    (`prompt_rows`) besides one row per sampled request; `sample_rows` picks the latter, in
    order. Without, every logits row is a sample and both are empty."""

    batch: ForwardBatch
    writes: ForwardWrites
    prompt_rows: tuple[PromptRows, ...] = ()
    sample_rows: tuple[int, ...] = ()


def build_forward_batch(chunks: list[ScheduledChunk], kv: KVCacheManager) -> PreparedForward:
    # Flat Python lists, one tensor each at the end: a decode row costs a few list appends,
    # not several small tensors.
    input_ids: list[int] = []
    positions: list[int] = []
    new_slots: list[int] = []
    block_tables: list[torch.Tensor] = []
    starts: list[int] = []
    context_lens: list[int] = []
    query_lens: list[int] = []
    logits_indices: list[int] = []
    prompt_rows: list[PromptRows] = []
    sample_rows: list[int] = []
    for chunk in chunks:
        ids, start, end = _chunk_tokens(chunk)
        request_id = chunk.request.request_id
        if chunk.request.needs_prompt_logprobs:
            prompt_rows += _prompt_rows(chunk.request, start, end, len(input_ids), logits_indices)
        input_ids.extend(ids)
        positions.extend(range(start, end))
        new_slots.extend(kv.slot_list(request_id, start, end))
        block_tables.append(kv.block_table(request_id, end))
        starts.append(start)
        context_lens.append(end)
        query_lens.append(end - start)
        if chunk.is_last_chunk:
            sample_rows.append(len(logits_indices))
            logits_indices.append(len(input_ids) - 1)
    # the token tensors go to the pool's device in one copy; the block tables stay on the host
    # (the attention plan pads and moves them once per forward, the check once per step)
    numbers = torch.tensor(input_ids + positions + new_slots + logits_indices, dtype=torch.int64)
    ids, pos, slots, sampled = numbers.to(kv.pool.device, non_blocking=True).split(
        [len(input_ids), len(positions), len(new_slots), len(logits_indices)])
    batch = ForwardBatch(input_ids=ids, positions=pos, slot_mapping=slots, query_lens=query_lens,
                         context_lens=context_lens, block_tables=block_tables, logits_indices=sampled)
    writes = kv.plan_writes([c.request.request_id for c in chunks], starts, context_lens)
    if not prompt_rows:
        return PreparedForward(batch, writes)
    return PreparedForward(batch, writes, tuple(prompt_rows), tuple(sample_rows))


def _prompt_rows(request: Request, start: int, end: int, first_token_row: int,
                 logits_indices: list[int]) -> list[PromptRows]:
    """The rows of a chunk [start, end) of `request` whose logits predict a prompt token that
    has no logprobs yet (the row of position p predicts token p + 1), appended to
    `logits_indices` (the chunk's tokens begin at flattened row `first_token_row`)."""
    assert request.prompt_logprobs is not None
    first = max(start, len(request.prompt_logprobs) - 1)
    last = min(end, request.num_prompt_tokens - 1)
    if first >= last:
        return []
    rows = PromptRows(request, len(logits_indices), first + 1, last - first)
    logits_indices.extend(range(first_token_row + first - start, first_token_row + last - start))
    return [rows]


def check_forward(prepared: PreparedForward, kv: KVCacheManager) -> list[IsolationViolation]:
    """Every reason to refuse a sequence of this batch, at most one per request.

    Always: the O(1)-per-sequence ownership and coverage check. In checked mode
    (`kv.config.check_kv`) also the per-slot, per-layer verification, O(context) per sequence.
    """
    if is_active(Fault.BYPASS_KV_CHECKS):
        return []  # test-only: a build with every read-before-write and ownership check removed
    violations = kv.check_forward(prepared.writes, prepared.batch)
    if kv.config.check_kv:
        refused = {v.request_id for v in violations}
        violations += [v for v in _verify_slots(prepared, kv) if v.request_id not in refused]
    return violations


def _verify_slots(prepared: PreparedForward, kv: KVCacheManager) -> list[IsolationViolation]:
    batch, writes = prepared.batch, prepared.writes
    violations = []
    new_slots = batch.slot_mapping.split(batch.query_lens)
    for request_id, end, slots in zip(writes.request_ids, batch.context_lens, new_slots):
        try:
            kv.verify_readable(request_id, kv.slots(request_id, 0, end), slots)
        except IsolationViolation as violation:
            violations.append(violation)
    return violations


def _chunk_tokens(chunk: ScheduledChunk) -> tuple[list[int], int, int]:
    """Token ids and [start, end) positions this chunk computes."""
    start, end = chunk.start_pos, chunk.start_pos + chunk.num_new_tokens
    if is_active(Fault.PLACEHOLDER_PREFILL) and start == 0 and end > 1:
        # Test-only: the incident's placeholder. One token stands in for the whole prompt,
        # yet the scheduler will count every prompt token as computed.
        return [0], end - 1, end
    return chunk.request.all_token_ids[start:end], start, end
