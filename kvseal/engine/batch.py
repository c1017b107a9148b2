"""Turn a scheduler's chunks into the model runner's `ForwardBatch`.

This is where checked mode (I4) looks at every request before the forward: each context slot
it will attend to must lie in its own pages and be written by it, before or in this forward.
"""

from __future__ import annotations

import torch

from kvseal._testing.faults import Fault, is_active
from kvseal.kvcache.manager import KVCacheManager
from kvseal.types import ForwardBatch, ScheduledChunk


def build_forward_batch(chunks: list[ScheduledChunk], kv: KVCacheManager, check: bool) -> ForwardBatch:
    input_ids: list[int] = []
    positions: list[torch.Tensor] = []
    new_slots: list[torch.Tensor] = []
    block_tables: list[torch.Tensor] = []
    context_lens: list[int] = []
    query_lens: list[int] = []
    logits_indices: list[int] = []
    for chunk in chunks:
        ids, start, end = _chunk_tokens(chunk)
        request_id = chunk.request.request_id
        chunk_slots = kv.slots(request_id, start, end)
        if check:
            kv.verify_readable(request_id, kv.slots(request_id, 0, end), chunk_slots)
        input_ids.extend(ids)
        positions.append(torch.arange(start, end, dtype=torch.int64))
        new_slots.append(chunk_slots)
        block_tables.append(kv.block_table(request_id, end))
        context_lens.append(end)
        query_lens.append(end - start)
        if chunk.is_last_chunk:
            logits_indices.append(len(input_ids) - 1)
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.cat(positions),
        slot_mapping=torch.cat(new_slots),
        query_lens=query_lens,
        context_lens=context_lens,
        block_tables=block_tables,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
    )


def _chunk_tokens(chunk: ScheduledChunk) -> tuple[list[int], int, int]:
    """Token ids and [start, end) positions this chunk computes."""
    start, end = chunk.start_pos, chunk.start_pos + chunk.num_new_tokens
    if is_active(Fault.PLACEHOLDER_PREFILL) and start == 0 and end > 1:
        # Test-only: the incident's placeholder. One token stands in for the whole prompt,
        # yet the scheduler will count every prompt token as computed.
        return [0], end - 1, end
    return chunk.request.all_token_ids[start:end], start, end
