"""A worker rank (1..N-1): its shard of the model and of every KV page, driven by rank 0.

It holds no scheduler and no allocator. Before each forward it replays the driver's ownership
changes on its own write records (`kvcache/mirror.py`) and runs the always-on check (I3, I4)
against them; the ranks exchange their refusals, and a forward runs only where no rank refused
(`TensorParallelDriver.agree`). Its written prefixes advance only by its own pool's writes.

Run as `python -m kvseal.parallel.worker SPEC` (SPEC: a `WorkerSpecMsg`, msgpack in hex; nothing
secret), started by the driver in a process group of its own, the ranks' key on its stdin; it
exits when the driver says stop or when any collective fails (the driver died or hung), and when
its parent dies.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import sys

import torch

from kvseal._testing.faults import Fault, is_active, switch
from kvseal.errors import ConfigError, IsolationViolation
from kvseal.kvcache.mirror import replay
from kvseal.kvcache.pool import KVPool
from kvseal.kvcache.records import ForwardWrites, WriteRecords
from kvseal.models.gguf_blocks import GgufBlocks
from kvseal.models.llama import CausalLM
from kvseal.models.loader import load_model
from kvseal.models.packed import pack_model
from kvseal.models.quant import quantize_model
from kvseal.models.tensor_parallel import RankLayout, widen_row_parallel
from kvseal.ops import Ops, select_ops
from kvseal.parallel.group import GroupSpec, RankFailure, RankGroup
from kvseal.parallel.handoff import empty_shard, moved_pages, record_landed, shard_bytes, write_shard
from kvseal.parallel.msgs import (
    ExportMsg,
    ImportMsg,
    InjectFaultMsg,
    KeepAliveMsg,
    ReadyMsg,
    RefusalsMsg,
    ShardReportMsg,
    StepMsg,
    StopMsg,
    WorkerSpecMsg,
    decode_from_rank,
    decode_spec,
    decode_to_rank,
    encode,
)
from kvseal.parallel.rank_device import RankDevice
from kvseal.parallel.tp_key import read_secret
from kvseal.types import ForwardBatch

logger = logging.getLogger("kvseal.parallel")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def finish_model(model: CausalLM, dtype: torch.dtype, quantization: str, ops: Ops, tp: int = 1,
                 blocks: GgufBlocks | None = None) -> CausalLM:
    """The loaded model (or shard of `tp` ranks) in its final form for `ops`: cast, quantized or
    packed; a shard's row-parallel linears keep float32 partial sums (`WidePartialLinear`) unless
    int8-quantized (the int8 kernels round their output to the model's dtype). blocks: the whole
    model's GGUF blocks for one-row steps (`pack_model`), never a shard's."""
    assert blocks is None or tp == 1, "a shard's linears are slices of the blocks' rows"
    model = model.to(dtype)
    if tp > 1 and quantization == "none" and (wide := widen_row_parallel(model, ops)):
        logger.info("tensor parallel: %d row-parallel linears sum their partials in float32", wide)
    model = quantize_model(model, quantization, ops)
    if quantization != "int8":
        model = pack_model(model, ops, weight_dtype=torch.bfloat16 if quantization == "bf16" else None,
                           blocks=blocks)
    model.use_ops(ops)
    return model


class WorkerRank:
    def __init__(self, spec: WorkerSpecMsg, group: RankGroup, device: RankDevice) -> None:
        """Load this rank's shard onto `device` (its model, pool, write records and every batch),
        report ready, and join the serving group (and on CUDA the forward's nccl group)."""
        self.spec, self.group, self.device = spec, group, device.device
        options = spec.options
        dtype = _DTYPES[options.dtype]
        loaded = load_model(options.model, dtype, rank=(spec.rank, spec.world_size))
        cfg = loaded.config
        self.layout = RankLayout.of(cfg, spec.rank, spec.world_size)
        ops = select_ops(options.native, options.device, attention_backend=options.attention_backend)
        self.model = finish_model(loaded.model.to(device=self.device), dtype, options.quantization, ops,
                                  spec.world_size)
        self.model.use_tensor_parallel(self.layout, group)
        self.records = WriteRecords(cfg.num_layers, options.num_pages, options.page_size, track_slots=options.check_kv,
                                    device=self.device)
        self.pool = KVPool(cfg.num_layers, options.num_pages, options.page_size, self.layout.num_kv_heads,
                           cfg.head_dim, dtype, observer=self.records, device=self.device)
        if options.check_kv:
            self.pool.fill(list(range(options.num_pages)), float("nan"))
        group.all_gather_bytes(encode(ReadyMsg(spec.rank, self.layout.num_kv_heads, options.num_pages,
                                               self.pool.num_bytes)))
        group.serving(device)

    def serve(self) -> None:
        """Run the driver's messages until it says stop; RankFailure when the group breaks."""
        while True:
            msg = decode_to_rank(self.group.broadcast_bytes(None))
            if isinstance(msg, StopMsg):
                return
            if isinstance(msg, KeepAliveMsg):
                continue
            if isinstance(msg, InjectFaultMsg):
                if msg.rank == self.spec.rank:
                    switch(Fault(msg.fault), msg.active)
                continue
            if isinstance(msg, ExportMsg):
                self.export(msg)
                continue
            if isinstance(msg, ImportMsg):
                self.import_shard(msg)
                continue
            self.step(msg)

    def step(self, msg: StepMsg) -> None:
        replay(msg.events, self.records, self.pool)
        batch = _batch(msg, self.device)
        if is_active(Fault.FOREIGN_PAGE):
            batch = _foreign_first_page(batch, self.records, msg.request_ids[0])
        starts = msg.starts
        if is_active(Fault.PLACEHOLDER_PREFILL):  # test-only: this rank's prompts stand in for one token
            starts = [end - 1 if start == 0 and end > 1 else start for start, end in zip(starts, msg.context_lens)]
        writes = self.records.plan(msg.request_ids, starts, msg.context_lens)
        refused = {} if is_active(Fault.BYPASS_KV_CHECKS) else self.check(writes, batch)
        if is_active(Fault.MISPLACED_KV_WRITE):
            batch = _misplaced_decode_writes(batch)
        answers = self.group.all_gather_bytes(encode(RefusalsMsg(refused)))
        if any(_refuses(a) for a in answers):
            return  # no rank runs this batch; the driver aborts the refused requests and builds another
        with self.records.recording(writes):
            self.model(batch, self.pool)

    def export(self, msg: ExportMsg) -> None:
        """PD prefill: report this rank's written prefix of the request, send rank 0 its heads."""
        replay(msg.events, self.records, self.pool)
        report = ShardReportMsg(self.spec.rank, self.records.written_prefix(msg.request_id))
        self.group.all_gather_bytes(encode(report))
        self.group.send(shard_bytes(self.pool, msg.pages), 0)

    def import_shard(self, msg: ImportMsg) -> None:
        """PD decode: write this rank's heads of a verified handoff into its pool, record them only
        once they are there, and report what its own records say (rank 0 refuses a short one)."""
        replay(msg.events, self.records, self.pool)
        pages = moved_pages(msg, self.spec.options.page_size)
        shard = empty_shard(self.pool, len(pages), self.layout.num_kv_heads)  # sized by this rank's own layout
        self.group.recv(shard, 0)
        if not is_active(Fault.DROP_IMPORT_SHARD):  # test-only: this rank's shard never reaches its pool
            write_shard(self.pool, pages, shard, slice(0, self.layout.num_kv_heads))
            try:
                record_landed(self.records, msg, self.spec.options.page_size)
            except IsolationViolation as violation:
                logger.error("tensor-parallel rank refuses to record an imported handoff: %s", violation)
        report = ShardReportMsg(self.spec.rank, self.records.written_prefix(msg.request_id))
        self.group.all_gather_bytes(encode(report))

    def check(self, writes: ForwardWrites, batch: ForwardBatch) -> dict[int, str]:
        """This rank's refusals: the always-on check (I3, I4), and in checked mode the per-slot
        verification of every context slot against this rank's own slot records."""
        refused = self.records.check_forward(writes, batch)
        if not self.spec.options.check_kv:
            return refused
        new_slots = batch.slot_mapping.split(batch.query_lens)
        for i, (table, end, slots) in enumerate(zip(batch.block_tables, batch.context_lens, new_slots)):
            if i not in refused and bool(self.records.unwritten_slots(self._context_slots(table, end), slots).any()):
                refused[i] = (f"request {writes.request_ids[i]} would read KV slots this rank never wrote "
                              f"(checked mode)")
        return refused

    def _context_slots(self, table: torch.Tensor, context_len: int) -> torch.Tensor:
        positions = torch.arange(context_len)
        page_size = self.spec.options.page_size
        return table[positions // page_size] * page_size + positions % page_size


def _misplaced_decode_writes(batch: ForwardBatch) -> ForwardBatch:
    """Test-only: each one-token row's K/V goes to the neighbouring slot of its page (slot ^ 1)."""
    slots = batch.slot_mapping.clone()
    ends = torch.tensor(batch.query_lens).cumsum(0)
    decodes = ends[torch.tensor(batch.query_lens) == 1] - 1
    slots[decodes] ^= 1
    return ForwardBatch(batch.input_ids, batch.positions, slots, batch.query_lens, batch.context_lens,
                        batch.block_tables, batch.logits_indices)


def _refuses(answer: bytes) -> bool:
    msg = decode_from_rank(answer)
    return isinstance(msg, RefusalsMsg) and bool(msg.refused)


def _batch(msg: StepMsg, device: str) -> ForwardBatch:
    """The step's batch as the engine builds it (`engine/batch.py`): the token tensors on the
    rank's device in one copy, the block tables on the host."""
    numbers = torch.tensor(msg.input_ids + msg.positions + msg.slot_mapping + msg.logits_indices, dtype=torch.int64)
    ids, pos, slots, sampled = numbers.to(device, non_blocking=True).split(
        [len(msg.input_ids), len(msg.positions), len(msg.slot_mapping), len(msg.logits_indices)])
    return ForwardBatch(input_ids=ids, positions=pos, slot_mapping=slots, query_lens=msg.query_lens,
                        context_lens=msg.context_lens,
                        block_tables=[torch.tensor(t, dtype=torch.int64) for t in msg.block_tables],
                        logits_indices=sampled)


def _foreign_first_page(batch: ForwardBatch, records: WriteRecords, request_id: str) -> ForwardBatch:
    """Test-only: this rank's block table of the first sequence names another request's page."""
    first = batch.block_tables[0]
    own_row = int(records.plan([request_id], [0], [0]).rows[0])
    foreign = ((records.page_row >= 0) & (records.page_row != own_row)).nonzero().flatten()
    if foreign.numel() == 0:
        return batch
    tables = [first.clone(), *batch.block_tables[1:]]
    tables[0][0] = int(foreign[0])
    return ForwardBatch(batch.input_ids, batch.positions, batch.slot_mapping, batch.query_lens,
                        batch.context_lens, tables, batch.logits_indices)


def _die_with_parent() -> None:
    """Linux: SIGKILL this rank when the process that started it (the driver) dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s rank %(process)d %(levelname)s %(message)s")
    _die_with_parent()
    spec = decode_spec(bytes.fromhex(argv[0]))
    try:
        key = read_secret(sys.stdin.buffer)
    except ConfigError as exc:
        logger.error("%s", exc)
        return 2
    torch.manual_seed(spec.options.seed)
    if spec.options.num_threads is not None:
        torch.set_num_threads(spec.options.num_threads)
    try:
        device = RankDevice.here(spec.options.device, spec.rank % spec.ranks_per_node, spec.ranks_per_node)
    except ConfigError as exc:
        logger.error("%s", exc)
        return 2
    device.enter()
    try:
        group = RankGroup(GroupSpec(spec.master_addr, spec.master_port, spec.world_size, spec.timeout_s,
                                    store_path=spec.store_path), spec.rank, key)
    except RankFailure as exc:
        logger.error("%s; this rank exits", exc)
        return 1
    try:
        WorkerRank(spec, group, device).serve()
    except RankFailure as exc:
        logger.error("%s; this rank exits", exc)
        return 1
    finally:
        group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
