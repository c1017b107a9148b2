"""tcp-stream with the KV pool on a GPU: both sides stage each block through pinned host memory
(`stream.staged_records`, `StreamReceiver`'s staged blocks). The staged path is checked here on
CPU tensors against the in-place path (the same bytes on the wire, the same pages landed); the
`gpu`-marked tests run it with CUDA pools and a whole PD handoff on CUDA."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pd_harness import PdPair
from test_handoff import GREEDY, PROMPTS, args, colocated
from test_stream_faults import HEAD_DIM, KEY, NUM_KV_HEADS, NUM_LAYERS, make_pool, plan, take_in

from kvseal import ConfigError
from kvseal.disagg.stream import StreamReceiver, StreamSender, staged_records
from kvseal.kvcache.pool import KVPool
from kvseal.models.loader import load_model

SRC, DEST, WRITTEN = [9, 2, 3, 4], [7, 1, 2, 12], [14, 14]  # scattered pages, a partial last page


def _wire(buffers: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(b) for b in buffers)


def test_staged_records_are_the_in_place_records_byte_for_byte() -> None:
    pool = make_pool()
    push = plan("t-1", SRC, WRITTEN, "127.0.0.1:1", DEST)
    staged, staged_bytes = staged_records(push, pool)
    in_place, in_place_bytes = StreamSender()._records(push, pool)
    assert staged_bytes == in_place_bytes and _wire(staged) == _wire(in_place)


def _staged_receiver(pool: KVPool) -> StreamReceiver:
    """A receiver that stages every block, as it does for a GPU pool, here on a host pool."""
    receiver = StreamReceiver(pool, NUM_LAYERS, "127.0.0.1")
    receiver._on_host, receiver._pool_bytes = False, None
    return receiver


def _push_and_check(receiver: StreamReceiver, src_pool: KVPool) -> None:
    """Push SRC into DEST by tcp-stream: the written positions land in decode's pages exactly,
    the rest of the partial last page is zero, no other page changes."""
    others = [p for p in range(receiver._pool.num_pages) if p not in DEST]
    before = [t[:, others].clone() for t in receiver._pool.k + receiver._pool.v]
    receiver.authorize("t-1", DEST, key=KEY)
    sender = StreamSender()
    try:
        sender.push(plan("t-1", SRC, WRITTEN, receiver.address, DEST), src_pool)
        take_in(receiver, lambda: receiver.settled("t-1"), "the push")
    finally:
        sender.close()
    landing = receiver.landed("t-1")
    assert landing is not None and receiver.take_refusals() == {}
    pool = receiver._pool
    for layer in range(NUM_LAYERS):
        for got_t, want_t in ((pool.k[layer], src_pool.k[layer]), (pool.v[layer], src_pool.v[layer])):
            got = got_t[:, DEST].reshape(NUM_KV_HEADS, -1, HEAD_DIM).cpu()
            want = want_t[:, SRC].reshape(NUM_KV_HEADS, -1, HEAD_DIM).cpu()
            assert torch.equal(got[:, :14], want[:, :14]) and torch.count_nonzero(got[:, 14:]) == 0
            assert landing.covered_prefix(layer, "k") == landing.covered_prefix(layer, "v") == 14
    assert all(torch.equal(a, t[:, others]) for a, t in zip(before, pool.k + pool.v))


def test_a_staged_receiver_lands_what_the_in_place_one_lands() -> None:
    receiver = _staged_receiver(make_pool())
    try:
        _push_and_check(receiver, make_pool())
    finally:
        receiver.close()


def _cuda_pool() -> KVPool:
    pool = make_pool()
    cuda = KVPool(NUM_LAYERS, pool.num_pages, pool.page_size, NUM_KV_HEADS, HEAD_DIM, torch.float32, device="cuda")
    for target, source in zip(cuda.k + cuda.v, pool.k + pool.v):
        target.copy_(source)
    return cuda


@pytest.mark.gpu
def test_a_push_between_cuda_pools_lands_exactly() -> None:
    receiver = StreamReceiver(_cuda_pool(), NUM_LAYERS, "127.0.0.1")
    try:
        _push_and_check(receiver, _cuda_pool())
    finally:
        receiver.close()


@pytest.fixture
def cuda_stream_pair(llama_dir: Path) -> Iterator[PdPair]:
    loaded = load_model(str(llama_dir), torch.float32)
    pair = PdPair(args(llama_dir, device="cuda"), args(llama_dir, device="cuda"), loaded=loaded,
                  kv_transport="tcp-stream")
    yield pair
    pair.close()


@pytest.mark.gpu
def test_greedy_pd_on_cuda_equals_colocated_on_cpu(cuda_stream_pair: PdPair, llama_dir: Path) -> None:
    expected = colocated(llama_dir, PROMPTS, GREEDY)
    assert [cuda_stream_pair.generate(p, GREEDY).token_ids for p in PROMPTS] == expected
    cuda_stream_pair.assert_clean()


@pytest.mark.gpu
def test_a_host_only_transport_is_refused_with_a_cuda_pool(llama_dir: Path) -> None:
    loaded = load_model(str(llama_dir), torch.float32)
    with pytest.raises(ConfigError, match="use --kv-transport tcp-stream"):
        PdPair(args(llama_dir, device="cuda"), args(llama_dir, device="cuda"), loaded=loaded, kv_transport="tcp")
