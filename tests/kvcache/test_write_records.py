"""The always-on write records (I3, I4) at the KV manager's level, with real pool writes.

Per request and per layer, the manager knows how many leading positions are written in the
current ownership of its pages; the check before every forward refuses a sequence whose
attended context those records (plus the forward's own writes) do not cover, or whose block
table names a page it does not own. Every test runs twice: with the records' torch ops, and with
the native kernels the engine hands them where it runs the C ops (`csrc/records.c`).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvseal.config import CacheConfig
from kvseal.engine.batch import PreparedForward, check_forward
from kvseal.errors import IsolationViolation
from kvseal.kvcache.manager import KVCacheManager
from kvseal.kvcache.records import RecordKernels
from kvseal.types import ForwardBatch

NUM_LAYERS, PAGE_SIZE = 3, 4


def make_kv(kernels: RecordKernels | None, check_kv: bool = False) -> KVCacheManager:
    config = CacheConfig(page_size=PAGE_SIZE, num_pages=8, dtype=torch.float32, check_kv=check_kv)
    return KVCacheManager(config, NUM_LAYERS, num_kv_heads=1, head_dim=2, record_kernels=kernels)


def prepare(kv: KVCacheManager, spans: dict[str, tuple[int, int]]) -> PreparedForward:
    """A batch in which request r computes positions [start, end) (what build_forward_batch makes)."""
    ids, starts, ends = list(spans), [s for s, _ in spans.values()], [e for _, e in spans.values()]
    batch = ForwardBatch(
        input_ids=torch.zeros(sum(e - s for s, e in zip(starts, ends)), dtype=torch.int64),
        positions=torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)]),
        slot_mapping=torch.cat([kv.slots(r, s, e) for r, s, e in zip(ids, starts, ends)]),
        query_lens=[e - s for s, e in zip(starts, ends)],
        context_lens=ends,
        block_tables=[kv.block_table(r, e) for r, e in zip(ids, ends)],
        logits_indices=torch.zeros(0, dtype=torch.int64),
    )
    return PreparedForward(batch, kv.plan_writes(ids, starts, ends))


def write_layers(kv: KVCacheManager, prepared: PreparedForward, layers: range) -> None:
    """Run the pool writes of a forward for `layers` only, as the model does, then stop."""
    slots = prepared.batch.slot_mapping
    kv_values = torch.ones(int(slots.shape[0]), 1, 2)
    with kv.recording(prepared.writes):
        for layer in layers:
            kv.pool.write(layer, slots, kv_values, kv_values)


def test_a_forward_is_recorded_per_layer_as_each_layer_writes(record_kernels: RecordKernels | None) -> None:
    kv = make_kv(record_kernels)
    kv.reserve("a", "alice", 9)
    prefill = prepare(kv, {"a": (0, 6)})
    assert check_forward(prefill, kv) == []
    write_layers(kv, prefill, range(1))  # the forward dies after layer 0
    assert kv.written_prefix("a") == [6, 0, 0]
    assert kv.num_written_tokens("a") == 0
    # The next step would attend to [0, 7) and write only [6, 7): layers 1 and 2 never wrote [0, 6).
    (violation,) = check_forward(prepare(kv, {"a": (6, 7)}), kv)
    assert violation.request_id == "a" and "layer 1 holds KV for [0, 0)" in str(violation)
    write_layers(kv, prefill, range(1, NUM_LAYERS))
    assert kv.written_prefix("a") == [6, 6, 6]
    assert check_forward(prepare(kv, {"a": (6, 7)}), kv) == []


@pytest.mark.parametrize("check_kv", [False, True])
def test_one_call_for_a_run_of_layers_records_as_a_call_per_layer(check_kv: bool,
                                                                 record_kernels: RecordKernels | None) -> None:
    """The decode loop writes every layer in one native call and reports the layers it wrote at
    once (`KVPool.write_layers_by`): the records must end exactly as after one report per layer,
    also when the call stopped early, in both modes, for sequences at different positions."""
    per_layer, at_once = make_kv(record_kernels, check_kv), make_kv(record_kernels, check_kv)
    for kv in (per_layer, at_once):
        kv.reserve("a", "alice", 9)
        kv.reserve("b", "bob", 9)
        write_layers(kv, prepare(kv, {"a": (0, 5), "b": (0, 3)}), range(NUM_LAYERS))
    # a call that stopped after two layers, then one that wrote all three
    for written, spans in ((2, {"a": (5, 6), "b": (3, 4)}), (NUM_LAYERS, {"a": (6, 7), "b": (4, 5)})):
        write_layers(per_layer, prepare(per_layer, spans), range(written))
        step = prepare(at_once, spans)
        with at_once.recording(step.writes):
            at_once.pool.write_layers_by(step.batch.slot_mapping, lambda n=written: n)
        assert torch.equal(per_layer.records.prefix, at_once.records.prefix)
        assert torch.equal(per_layer.records.slot_generation, at_once.records.slot_generation)
        end = spans["a"][1]
        assert at_once.written_prefix("a") == [end] * written + [end - 1] * (NUM_LAYERS - written)
        if written < NUM_LAYERS:  # the layer the call never reached refuses the next step, then is redone
            for kv in (per_layer, at_once):
                (violation,) = check_forward(prepare(kv, {"a": (6, 7)}), kv)
                assert "layer 2 holds KV for [0, 5)" in str(violation)
                write_layers(kv, prepare(kv, spans), range(written, NUM_LAYERS))
    assert at_once.written_prefix("b") == [5] * NUM_LAYERS


def test_only_the_uncovered_sequence_is_refused(record_kernels: RecordKernels | None) -> None:
    kv = make_kv(record_kernels)
    for request_id in ("a", "b"):
        kv.reserve(request_id, request_id, 8)
    write_layers(kv, prepare(kv, {"a": (0, 5)}), range(NUM_LAYERS))
    refused = check_forward(prepare(kv, {"a": (5, 6), "b": (4, 5)}), kv)
    assert [v.request_id for v in refused] == ["b"]


def test_a_block_table_naming_a_foreign_page_is_refused(record_kernels: RecordKernels | None) -> None:
    kv = make_kv(record_kernels)
    kv.reserve("a", "alice", 8)
    kv.reserve("b", "bob", 8)
    prepared = prepare(kv, {"a": (0, 8), "b": (0, 8)})
    stolen = kv.allocator.pages_of("a")[1]
    tables = [prepared.batch.block_tables[0], torch.tensor([kv.allocator.pages_of("b")[0], stolen])]
    forged = dataclasses.replace(prepared, batch=dataclasses.replace(prepared.batch, block_tables=tables))
    (violation,) = check_forward(forged, kv)
    assert violation.request_id == "b" and f"pages [{stolen}] it does not own" in str(violation)
    # A write into a page the request does not own is refused too.
    slots = prepared.batch.slot_mapping.clone()
    slots[8] = stolen * PAGE_SIZE
    forged = dataclasses.replace(prepared, batch=dataclasses.replace(prepared.batch, slot_mapping=slots))
    assert [v.request_id for v in check_forward(forged, kv)] == ["b"]


def test_records_start_unwritten_in_every_new_ownership_period(record_kernels: RecordKernels | None) -> None:
    kv = make_kv(record_kernels)
    kv.reserve("a", "alice", 8)
    write_layers(kv, prepare(kv, {"a": (0, 8)}), range(NUM_LAYERS))
    pages = kv.allocator.pages_of("a")
    kv.free("a")
    assert kv.written_prefix("a") == [0, 0, 0]
    kv.reserve("b", "bob", 8)
    assert kv.allocator.pages_of("b") == pages and kv.written_prefix("b") == [0, 0, 0]
    assert len(check_forward(prepare(kv, {"b": (7, 8)}), kv)) == 1
    kv.reserve("a", "alice", 4)  # the same id again: a new ownership period
    assert kv.written_prefix("a") == [0, 0, 0]


def test_record_written_accepts_contiguous_growth_only(record_kernels: RecordKernels | None) -> None:
    kv = make_kv(record_kernels)
    kv.reserve("a", "alice", 8)
    for layer in range(NUM_LAYERS):
        kv.record_written("a", layer, 0, 5)
    kv.record_written("a", 0, 5, 8)
    assert kv.written_prefix("a") == [8, 5, 5]
    bad = [("a", 1, 6, 8, "not contiguous"),  # a gap
           ("a", 1, 0, 3, "not contiguous"),  # a rewrite
           ("a", 1, 5, 5, "not contiguous"),  # empty
           ("a", 1, 5, 9, "within the 8 positions it owns"),  # past its pages
           ("a", NUM_LAYERS, 0, 1, "does not exist"),
           ("nobody", 0, 0, 1, "owns no KV pages")]
    for request_id, layer, start, end, message in bad:
        with pytest.raises(IsolationViolation, match=message):
            kv.record_written(request_id, layer, start, end)
    assert kv.written_prefix("a") == [8, 5, 5]


def test_transport_writes_cover_a_decode_only_when_every_layer_arrived(record_kernels: RecordKernels | None) -> None:
    kv = make_kv(record_kernels)
    kv.reserve("a", "alice", 9)
    for layer in range(NUM_LAYERS - 1):
        kv.record_written("a", layer, 0, 8)
    assert len(check_forward(prepare(kv, {"a": (8, 9)}), kv)) == 1
    kv.record_written("a", NUM_LAYERS - 1, 0, 8)
    assert check_forward(prepare(kv, {"a": (8, 9)}), kv) == []


def test_checked_mode_verifies_slots_the_records_only_claim(record_kernels: RecordKernels | None) -> None:
    """Checked mode does not trust the prefix: a record with no pool write behind it (a
    bookkeeping bug) passes the always-on check but not the per-slot verification."""
    kv = make_kv(record_kernels, check_kv=True)
    kv.reserve("a", "alice", 9)
    write_layers(kv, prepare(kv, {"a": (0, 4)}), range(NUM_LAYERS))
    for layer in range(NUM_LAYERS):
        kv.records.prefix[layer, kv.records._rows["a"]] = 8  # claims [4, 8) that nobody wrote
    decode = prepare(kv, {"a": (8, 9)})
    assert kv.check_forward(decode.writes, decode.batch) == []
    (violation,) = check_forward(decode, kv)
    assert "4 KV slots it never wrote (first at position 4, layer 0)" in str(violation)


def test_checked_mode_refuses_a_layer_the_forward_never_wrote(record_kernels: RecordKernels | None) -> None:
    kv = make_kv(record_kernels, check_kv=True)
    kv.reserve("a", "alice", 9)
    write_layers(kv, prepare(kv, {"a": (0, 8)}), range(NUM_LAYERS))
    assert check_forward(prepare(kv, {"a": (8, 9)}), kv) == []
    kv.records.slot_generation[2, kv.slots("a", 3, 4)] = -1  # as if layer 2 had skipped position 3
    (violation,) = check_forward(prepare(kv, {"a": (8, 9)}), kv)
    assert "1 KV slots it never wrote (first at position 3, layer 2)" in str(violation)


def test_integrity_check_fails_when_records_and_allocator_disagree(record_kernels: RecordKernels | None) -> None:
    kv = make_kv(record_kernels)
    kv.reserve("a", "alice", 8)
    kv.reserve("b", "bob", 4)
    kv.check_integrity()
    kv.records.page_row[kv.allocator.pages_of("a")[1]] = kv.records._rows["b"]
    with pytest.raises(AssertionError, match="owner row disagrees"):
        kv.check_integrity()
