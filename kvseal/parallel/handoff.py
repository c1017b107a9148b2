"""A PD handoff between tensor-parallel engines: full pages on the wire, head shards in the pools.

Every rank of a tensor-parallel engine holds only its KV heads of every page, while the PD wire
protocol (and `kv_layout`, which the frontend matches between the roles) carries full pages, every
KV head. Rank 0 therefore keeps one more pool of full pages (`RankHandoff.wire`, the same page ids
as the engine's pool), which the transports read and write as they read and write a one-rank
engine's pool; the transports do not change, and a prefill engine of N ranks hands off to a decode
engine of any M ranks.

- Prefill (`gather`): before the push, every rank reports its written prefix of the request from
  its own write records and sends rank 0 its heads of the request's pages (an `ExportMsg`, one
  all-gather, then each rank's exact heads point to point; rank 0 copies its own from its pool).
  What is pushed and committed is the least any rank wrote: a rank that did not write a position
  never lets it leave.
- Decode (`scatter`): after rank 0 verified the commit against the wire pool's landing records,
  it sends each rank its heads of the transferred positions (an `ImportMsg`, point to point;
  rank 0 copies its own into its pool); each rank writes them into its own pool, records them in
  its own write records only once they are there, and reports its written prefix (one
  all-gather). A rank whose prefix falls short refuses
  the handoff for all; were that refusal bypassed, the rank's always-on check refuses the first
  decode step (I4), and a refusal on any rank aborts the request on all.

A staged page is zeroed as soon as it is no longer needed (after the push; when the transfer's
reservation is released or taken), so no request's KV outlives its handoff in the wire pool.
Every collective is bounded by the group's timeout: a rank that dies mid-handoff raises
`RankFailure` and the engine fails closed.
"""

from __future__ import annotations

import torch

from kvseal.config import ModelConfig
from kvseal.errors import IsolationViolation
from kvseal.kvcache.manager import KVCacheManager
from kvseal.kvcache.pool import KVPool
from kvseal.kvcache.records import WriteRecords
from kvseal.models.tensor_parallel import RankLayout
from kvseal.parallel.driver import TensorParallelDriver
from kvseal.parallel.msgs import ExportMsg, ImportMsg, ShardReportMsg, decode_from_rank, encode


def shard_bytes(pool: KVPool, pages: list[int], heads: slice | None = None) -> torch.Tensor:
    """`heads` (default: every head) of `pages` of every layer, K then V, as one byte tensor
    [layers, 2, heads, len(pages), page_size, head_dim], on the CPU (the gloo group carries it)
    whatever the pool's device: each page read once, straight into its place."""
    index = torch.tensor(pages, dtype=torch.int64, device=pool.device)
    picked = heads or slice(0, pool.k[0].shape[0])
    shard = empty_shard(pool, len(pages), picked.stop - picked.start, pool.device)
    values = shard.view(pool.k[0].dtype)
    for layer, (k, v) in enumerate(zip(pool.k, pool.v)):
        torch.index_select(k[picked], 1, index, out=values[layer, 0])
        torch.index_select(v[picked], 1, index, out=values[layer, 1])
    return shard.cpu()


def empty_shard(pool: KVPool, num_pages: int, num_heads: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A buffer shaped like `shard_bytes` of `num_pages` pages and `num_heads` heads."""
    _, page_size, head_dim = pool.page_shape()
    shape = (len(pool.k), 2, num_heads, num_pages, page_size, head_dim)
    return torch.empty(shape, dtype=pool.k[0].dtype, device=device).view(torch.uint8)


def write_shard(pool: KVPool, pages: list[int], shard: torch.Tensor, heads: slice) -> None:
    """A `shard_bytes` tensor of `heads` (on the CPU) into `heads` of `pages` of every layer."""
    values = shard.view(pool.k[0].dtype).to(pool.device)
    index = torch.tensor(pages, dtype=torch.int64, device=pool.device)
    for layer, (k, v) in enumerate(zip(pool.k, pool.v)):
        k[heads].index_copy_(1, index, values[layer, 0])
        v[heads].index_copy_(1, index, values[layer, 1])


def copy_heads(source: KVPool, target: KVPool, pages: list[int], heads: slice) -> None:
    """`heads` of `pages` of every layer from `source` into `target` (rank 0's own heads between
    its pool and the staging pool: no byte shard in between)."""
    index = torch.tensor(pages, dtype=torch.int64, device=target.device)
    for layer in range(len(target.k)):
        for src, dst in ((source.k[layer], target.k[layer]), (source.v[layer], target.v[layer])):
            dst[heads].index_copy_(1, index, src[heads].index_select(1, index.to(src.device)).to(dst.device))


def record_landed(records: WriteRecords, msg: ImportMsg, page_size: int) -> None:
    """Record [start, end) of every layer as written (its KV is in this rank's pool now)."""
    positions = torch.arange(msg.start, msg.end)
    slots = torch.tensor(msg.pages)[positions // page_size] * page_size + positions % page_size
    for layer in range(records.num_layers):
        records.record(msg.request_id, layer, msg.start, msg.end, slots if records.track_slots else None)


def moved_pages(msg: ImportMsg, page_size: int) -> list[int]:
    """The pages that hold positions [start, end) (start is page-aligned)."""
    return msg.pages[msg.start // page_size:-(-msg.end // page_size)]


class RankHandoff:
    """Rank 0's side of a PD handoff under tensor parallelism (see the module docstring)."""

    def __init__(self, driver: TensorParallelDriver, cfg: ModelConfig, kv: KVCacheManager) -> None:
        self.driver, self.kv = driver, kv
        world = driver.group.world_size
        self.layouts = [RankLayout.of(cfg, rank, world) for rank in range(world)]
        pool = kv.pool
        _, page_size, head_dim = pool.page_shape()
        self.wire = KVPool(len(pool.k), pool.num_pages, page_size, cfg.num_kv_heads, head_dim, pool.k[0].dtype)

    def _heads(self, rank: int) -> slice:
        layout = self.layouts[rank]
        return slice(layout.kv_head_start, layout.kv_head_start + layout.num_kv_heads)

    def gather(self, request_id: str, pages: list[int]) -> list[int]:
        """Every rank's heads of `pages` into the wire pool; returns, per layer, the least written
        prefix of the request over the ranks (what may be pushed and committed)."""
        msg = ExportMsg(self.kv.drain_events(), request_id, list(pages))
        group = self.driver.group
        with self.driver.exclusive():
            group.broadcast_bytes(encode(msg))
            answers = group.all_gather_bytes(encode(ShardReportMsg(0, self.kv.written_prefix(request_id))))
            copy_heads(self.kv.pool, self.wire, pages, self._heads(0))
            done = {self.layouts[0].kv_head_start}
            for rank in range(1, len(self.layouts)):  # each rank's exact heads, sized by its layout here
                part = empty_shard(self.wire, len(pages), self.layouts[rank].num_kv_heads)
                group.recv(part, rank)
                if self.layouts[rank].kv_head_start not in done:  # a replicated head: its first rank's copy
                    done.add(self.layouts[rank].kv_head_start)
                    write_shard(self.wire, pages, part, self._heads(rank))
        reports = [decode_from_rank(a) for a in answers]
        written = [r.written for r in reports if isinstance(r, ShardReportMsg)]
        if len(written) != len(self.layouts):
            raise IsolationViolation(request_id, "a tensor-parallel rank did not report its written prefix")
        return [min(layer) for layer in zip(*written)]

    def scatter(self, request_id: str, pages: list[int], start: int, end: int) -> str | None:
        """Hand every rank its heads of positions [start, end) from the wire pool (rank 0 copies its
        own; the caller records rank 0's); None when every other rank reports them written, else why not."""
        msg = ImportMsg(self.kv.drain_events(), request_id, list(pages), start, end)
        moved = moved_pages(msg, self.kv.page_size)
        group = self.driver.group
        with self.driver.exclusive():
            group.broadcast_bytes(encode(msg))
            for rank in range(1, len(self.layouts)):
                group.send(shard_bytes(self.wire, moved, self._heads(rank)), rank)
            copy_heads(self.wire, self.kv.pool, moved, self._heads(0))
            answers = group.all_gather_bytes(encode(ShardReportMsg(0, [])))
        short = []
        for answer in answers[1:]:
            report = decode_from_rank(answer)
            if not isinstance(report, ShardReportMsg) or any(w < end for w in report.written):
                short.append(getattr(report, "rank", "?"))
        if short:
            return (f"the KV of positions [{start}, {end}) did not land on tensor-parallel rank(s) "
                    f"{', '.join(map(str, short))} (their own write records)")
        return None

    def clear(self, pages: list[int]) -> None:
        """Zero staged pages: nothing of a handoff stays in the wire pool after it."""
        if pages:
            self.wire.fill(list(pages), 0.0)
