"""The driver's messages to its worker ranks, and theirs back: msgspec structs, one codec.

Rank 0 broadcasts a `ToRankMsg` over the process group; every rank answers a step with a
`RefusalsMsg` (all-gathered, so every rank knows whether the forward runs).
"""

from __future__ import annotations

import msgspec

from kvseal.config import NativeMode
from kvseal.kvcache.mirror import OwnershipEvent


class RankOptions(msgspec.Struct, frozen=True):
    """How the worker ranks load and run (the engine's own settings, passed on)."""

    model: str
    dtype: str
    quantization: str
    native: NativeMode
    seed: int
    num_threads: int | None
    num_pages: int
    page_size: int
    check_kv: bool
    device: str = "cpu"  # "cpu" or "cuda" (each rank: cuda:<local rank>, `rank_device.RankDevice`)
    attention_backend: str = "auto"


class WorkerSpecMsg(msgspec.Struct, tag="worker_spec"):
    """What a worker rank needs to start: given on its command line (msgpack, hex), which any local
    user can read in /proc/PID/cmdline, so nothing secret (the ranks' key comes on stdin)."""

    options: RankOptions
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    timeout_s: float
    store_path: str | None = None  # one node: the file store in rank 0's private folder (not secret)
    ranks_per_node: int = 1  # this rank's local rank is rank % ranks_per_node (its GPU on CUDA)


class StepMsg(msgspec.Struct, tag="step"):
    """One forward: the ownership changes since the last step, then the batch and what it writes."""

    events: list[OwnershipEvent]
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    logits_indices: list[int]
    request_ids: list[str]
    starts: list[int]


class ExportMsg(msgspec.Struct, tag="export"):
    """PD prefill: the ownership changes since the last step, then every rank reports its written
    prefix of `request_id` and sends rank 0 its KV heads of `pages` (`parallel/handoff.py`)."""

    events: list[OwnershipEvent]
    request_id: str
    pages: list[int]


class ImportMsg(msgspec.Struct, tag="import"):
    """PD decode, after rank 0 verified the commit: the ownership changes since the last step,
    then rank 0 scatters each rank its heads of positions [start, end) of `request_id`, whose
    pages (position order, from position 0) are `pages`; every rank writes its shard into its
    own pool, records it, and reports its written prefix (`ShardReportMsg`)."""

    events: list[OwnershipEvent]
    request_id: str
    pages: list[int]
    start: int  # page-aligned: decode's prefix-cache hit ends here
    end: int


class KeepAliveMsg(msgspec.Struct, tag="keep_alive"):
    """Nothing to run: sent by an idle driver so that a worker's bounded wait for the next
    message tells a quiet driver from a dead or hung one."""


class StopMsg(msgspec.Struct, tag="stop"):
    """Leave the group and exit."""


class InjectFaultMsg(msgspec.Struct, tag="inject_fault"):
    """Test-only (`TensorParallelDriver.inject_fault_on_rank`): switch a `kvseal._testing` fault
    on (or off) in one worker rank. No flag or config can send it."""

    rank: int
    fault: str
    active: bool


class RefusalsMsg(msgspec.Struct, tag="refusals"):
    """A rank's refusals of a step: sequence index -> why (empty: it may run)."""

    refused: dict[int, str]


class ShardReportMsg(msgspec.Struct, tag="shard_report"):
    """A rank's written prefix of one request, per layer, from its own write records: what a PD
    handoff may send (prefill: the least over the ranks) or what landed on it (decode)."""

    rank: int
    written: list[int]


class ReadyMsg(msgspec.Struct, tag="ready"):
    """A rank is loaded: its shard's KV heads and pool, for the driver's start-up log and checks."""

    rank: int
    num_kv_heads: int
    num_pages: int
    pool_bytes: int


ToRankMsg = StepMsg | ExportMsg | ImportMsg | KeepAliveMsg | StopMsg | InjectFaultMsg
FromRankMsg = RefusalsMsg | ReadyMsg | ShardReportMsg

_encoder = msgspec.msgpack.Encoder()
_to_rank = msgspec.msgpack.Decoder(ToRankMsg)
_from_rank = msgspec.msgpack.Decoder(FromRankMsg)
_spec = msgspec.msgpack.Decoder(WorkerSpecMsg)


def encode(msg: ToRankMsg | FromRankMsg | WorkerSpecMsg) -> bytes:
    return _encoder.encode(msg)


def decode_to_rank(data: bytes) -> ToRankMsg:
    return _to_rank.decode(data)


def decode_from_rank(data: bytes) -> FromRankMsg:
    return _from_rank.decode(data)


def decode_spec(data: bytes) -> WorkerSpecMsg:
    return _spec.decode(data)
