"""CPU cost of the always-on KV coverage check (I3/I4) for one decode step, without a model.

Builds the state of a SmolLM2-135M-shaped engine (30 layers, 3 KV heads x 64, bf16, page 16)
with --num-seqs requests of --context tokens each, every layer written, and times, in CPU
time of this process (steady on a shared machine): the batch build (which includes planning
the writes), `check_forward` (and the same call with BYPASS_KV_CHECKS), and the per-layer
write records of one forward. Compare with a decode step's time in docs/BENCHMARKS.md.

    python bench/kv_check_micro.py --num-seqs 64 --context 384
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvseal._testing.faults import Fault, inject
from kvseal.config import CacheConfig
from kvseal.engine.batch import PreparedForward, build_forward_batch, check_forward
from kvseal.kvcache.manager import KVCacheManager
from kvseal.kvcache.records import RecordKernels
from kvseal.ops import select_ops
from kvseal.types import Request, SamplingParams, ScheduledChunk

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 30, 3, 64, 16


def decode_state(num_seqs: int, context: int,
                 kernels: RecordKernels | None) -> tuple[KVCacheManager, list[ScheduledChunk]]:
    """Every request has `context - 1` tokens written in every layer and decodes one more."""
    num_pages = num_seqs * -(-context // PAGE_SIZE)
    kv = KVCacheManager(CacheConfig(PAGE_SIZE, num_pages, torch.bfloat16), NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM,
                        record_kernels=kernels)
    chunks = []
    for i in range(num_seqs):
        request = Request(f"r{i}", "t", list(range(context - 1)), SamplingParams(max_tokens=2))
        request.output_token_ids = [1]
        request.num_computed_tokens = context - 1
        kv.reserve(request.request_id, "t", context)
        for layer in range(NUM_LAYERS):
            kv.record_written(request.request_id, layer, 0, context - 1)
        chunks.append(ScheduledChunk(request, 1))
    return kv, chunks


def cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    start = time.process_time()
    for _ in range(repeats):
        fn()
    return (time.process_time() - start) / repeats * 1e3


def record_one_forward(kv: KVCacheManager, prepared: PreparedForward) -> None:
    with kv.recording(prepared.writes):
        kv.records.on_layers_write(NUM_LAYERS, prepared.batch.slot_mapping)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=384)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    native = select_ops("require").record_kernels()
    for name, kernels in (("torch ops", None), ("native", native)):
        print(f"{name}: CPU ms per decode step (batch {args.num_seqs}, context {args.context}, {NUM_LAYERS} layers): "
              + measure(args.num_seqs, args.context, kernels, args.repeats))


def measure(num_seqs: int, context: int, kernels: RecordKernels | None, repeats: int) -> str:
    kv, chunks = decode_state(num_seqs, context, kernels)
    prepared = build_forward_batch(chunks, kv)
    assert check_forward(prepared, kv) == []
    build = cpu_ms(lambda: build_forward_batch(chunks, kv), repeats)
    check = cpu_ms(lambda: check_forward(prepared, kv), repeats)
    with inject(Fault.BYPASS_KV_CHECKS):
        bypassed = cpu_ms(lambda: check_forward(prepared, kv), repeats)
    record = cpu_ms(lambda: record_one_forward(kv, prepared), repeats)
    return (f"batch build {build:.3f}; check_forward {check:.3f} (bypassed {bypassed:.4f}); "
            f"write records of one forward {record:.3f}")

if __name__ == "__main__":
    main()
