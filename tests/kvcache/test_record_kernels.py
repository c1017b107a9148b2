"""The native record kernels (`csrc/records.c`) give the always-on check's answer and the records'
growth exactly as the records' torch ops do: on random records and random batches that name
own pages, cached pages of the row's namespace and of another, free pages and other requests'
pages, with prefixes short of, at and past each sequence's first new position. Where the torch
ops cannot answer (a page id or slot outside the pool, which they index with) the kernel refuses
the sequence."""

from __future__ import annotations

import random

import pytest
import torch
from built_kernels import native_ops, needs_kernels

from kvseal.kvcache.records import CACHED_ROW, RecordKernels, WriteRecords
from kvseal.types import ForwardBatch

NUM_LAYERS, NUM_PAGES, PAGE_SIZE = 3, 24, 4


def _kernels() -> RecordKernels:
    kernels = native_ops().record_kernels()
    assert kernels is not None
    return kernels


def _records(rng: random.Random, kernels: RecordKernels | None) -> tuple[WriteRecords, dict[str, list[int]]]:
    """Records of a few requests in two namespaces, some pages cached, prefixes at random (the
    same for a given rng state whatever the kernels)."""
    records = WriteRecords(NUM_LAYERS, NUM_PAGES, PAGE_SIZE, track_slots=False, kernels=kernels)
    pages = list(range(NUM_PAGES))
    rng.shuffle(pages)
    held: dict[str, list[int]] = {}
    for i in range(rng.randint(1, 9)):  # more than the first 8 rows: the records grow theirs
        request_id, take = f"r{i}", rng.randint(1, 3)
        if len(pages) < take:
            break
        held[request_id] = [pages.pop() for _ in range(take)]
        records.hand_out(request_id, held[request_id], [1] * take, namespace=f"ns{i % 2}")
        for layer in range(NUM_LAYERS):
            end = rng.randint(0, take * PAGE_SIZE)
            if end:
                records.record(request_id, layer, 0, end, None)
    for request_id, own in list(held.items()):
        if rng.random() < 0.3 and min(records.written_prefix(request_id)) >= PAGE_SIZE:
            records.publish(request_id, own[0], 0, f"ns{int(request_id[1:]) % 2}")
    return records, held


def _batch(rng: random.Random, records: WriteRecords, held: dict[str, list[int]],
           outside: bool) -> tuple[list[str], list[int], list[int], ForwardBatch]:
    """A batch over some of the requests (and one unknown id): each reads a table of pages drawn
    mostly from its own, sometimes anyone's, and writes slots in them."""
    ids = rng.sample(sorted(held), rng.randint(1, len(held))) + (["nobody"] if rng.random() < 0.2 else [])
    highest = NUM_PAGES + 2 if outside else NUM_PAGES - 1
    tables, slots, starts, ends = [], [], [], []
    for request_id in ids:
        own = held.get(request_id, [0])
        table = [rng.choice(own) if rng.random() < 0.8 else rng.randint(0, highest) for _ in range(rng.randint(0, 4))]
        news = [rng.choice(own) * PAGE_SIZE + rng.randrange(PAGE_SIZE) if rng.random() < 0.9
                else rng.randint(0, (highest + 1) * PAGE_SIZE - 1) for _ in range(rng.randint(1, 3))]
        start = rng.randint(0, 3 * PAGE_SIZE)
        tables.append(torch.tensor(table, dtype=torch.int64))
        slots += news
        starts.append(start)
        ends.append(start + len(news))
    batch = ForwardBatch(input_ids=torch.zeros(len(slots), dtype=torch.int64),
                         positions=torch.zeros(len(slots), dtype=torch.int64),
                         slot_mapping=torch.tensor(slots, dtype=torch.int64),
                         query_lens=[e - s for s, e in zip(starts, ends)], context_lens=ends, block_tables=tables,
                         logits_indices=torch.zeros(0, dtype=torch.int64))
    return ids, starts, ends, batch


@needs_kernels
@pytest.mark.parametrize("seed", range(40))
def test_the_kernels_refuse_and_grow_as_the_torch_ops_do(seed: int) -> None:
    torch_ops, _ = _records(random.Random(seed), None)
    native, held = _records(random.Random(seed), _kernels())
    assert torch.equal(torch_ops.prefix, native.prefix) and torch.equal(torch_ops.page_row, native.page_row)
    rng = random.Random(seed + 1000)
    for _ in range(6):
        ids, starts, ends, batch = _batch(rng, native, held, outside=False)
        answers = [r.check_forward(r.plan(ids, starts, ends), batch) for r in (torch_ops, native)]
        assert answers[0] == answers[1]
        layers = slice(rng.randint(0, NUM_LAYERS - 1), rng.randint(1, NUM_LAYERS))
        for records in (torch_ops, native):
            with records.recording(records.plan(ids, starts, ends)):
                records._advance(layers, batch.slot_mapping)
        assert torch.equal(torch_ops.prefix, native.prefix)


@needs_kernels
def test_the_kernels_refuse_a_page_or_slot_outside_the_pool() -> None:
    records = WriteRecords(NUM_LAYERS, NUM_PAGES, PAGE_SIZE, track_slots=False, kernels=_kernels())
    records.hand_out("a", [3], [1])
    for table, slots in (([3, NUM_PAGES], [12]), ([3, -1], [12]), ([3], [NUM_PAGES * PAGE_SIZE]), ([3], [-1])):
        batch = ForwardBatch(input_ids=torch.zeros(1, dtype=torch.int64), positions=torch.zeros(1, dtype=torch.int64),
                             slot_mapping=torch.tensor(slots), query_lens=[1], context_lens=[1],
                             block_tables=[torch.tensor(table)], logits_indices=torch.zeros(0, dtype=torch.int64))
        (why,) = records.check_forward(records.plan(["a"], [0], [1]), batch).values()
        assert "would read or write pages" in why and "it does not own" in why
    assert int(records.page_row[3]) == 0 and CACHED_ROW not in records.page_row.tolist()


@needs_kernels
@pytest.mark.parametrize("seed", range(10))
def test_the_kernels_refuse_what_is_outside_the_pool_and_agree_elsewhere(seed: int) -> None:
    """With ids outside the pool in the batch, every sequence the torch ops could answer gets
    their answer, and those naming an id outside the pool are refused."""
    records, held = _records(random.Random(seed), _kernels())
    reference, _ = _records(random.Random(seed), None)
    rng = random.Random(seed + 2000)
    for _ in range(6):
        ids, starts, ends, batch = _batch(rng, records, held, outside=True)
        refused = records.check_forward(records.plan(ids, starts, ends), batch)
        at = 0
        for i, table in enumerate(batch.block_tables):
            slots = batch.slot_mapping[at:at + batch.query_lens[i]]
            at += batch.query_lens[i]
            if max(table.tolist(), default=0) >= NUM_PAGES or int(slots.max()) >= NUM_PAGES * PAGE_SIZE:
                assert i in refused
                continue
            alone = ForwardBatch(input_ids=torch.zeros(len(slots), dtype=torch.int64), positions=slots * 0,
                                 slot_mapping=slots, query_lens=[batch.query_lens[i]], context_lens=[ends[i]],
                                 block_tables=[table], logits_indices=torch.zeros(0, dtype=torch.int64))
            answer = reference.check_forward(reference.plan([ids[i]], [starts[i]], [ends[i]]), alone)
            assert refused.get(i) == answer.get(0)
