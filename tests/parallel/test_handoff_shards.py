"""The byte shards a PD handoff moves between tensor-parallel ranks (`parallel/handoff.py`): a
rank's heads of exactly the given pages, read straight from its pool, and written back into
exactly those pages and heads, nothing else touched; rank 0's own heads move between its pool
and the staging pool without a shard."""

from __future__ import annotations

import pytest
import torch

from kvseal.kvcache.pool import KVPool
from kvseal.parallel.handoff import copy_heads, shard_bytes, write_shard

PAGES = [4, 1, 3]  # out of order: a shard follows the list


def _pool(fill: float | None = None) -> KVPool:
    pool = KVPool(3, 6, 4, 3, 8, torch.bfloat16)
    for layer, (k, v) in enumerate(zip(pool.k, pool.v)):
        if fill is None:
            k.copy_(torch.randn(k.shape, generator=torch.Generator().manual_seed(layer)))
            v.copy_(torch.randn(v.shape, generator=torch.Generator().manual_seed(100 + layer)))
        else:
            k.fill_(fill)
            v.fill_(fill)
    return pool


def _assert_only(target: KVPool, source: KVPool, heads: slice) -> None:
    """target holds source's `heads` of PAGES and NaN everywhere else."""
    others = [p for p in range(6) if p not in PAGES]
    rest = [h for h in range(3) if not heads.start <= h < heads.stop]
    for layer in range(3):
        for mine, theirs in ((target.k[layer], source.k[layer]), (target.v[layer], source.v[layer])):
            assert torch.equal(mine[heads][:, PAGES], theirs[heads][:, PAGES])
            assert mine[:, others].isnan().all(), "a page outside the list was written"
            assert mine[rest].isnan().all(), "a head outside the slice was written"


@pytest.mark.parametrize("heads", [None, slice(1, 3), slice(2, 3)])
def test_a_shard_holds_exactly_its_pages_and_heads(heads: slice | None) -> None:
    source = _pool()
    picked = heads or slice(0, 3)
    shard = shard_bytes(source, PAGES, heads)
    count = picked.stop - picked.start
    assert shard.dtype == torch.uint8 and shard.numel() == 3 * 2 * count * len(PAGES) * 4 * 8 * 2  # no padding
    values = shard.view(torch.bfloat16).view(3, 2, count, len(PAGES), 4, 8)
    index = torch.tensor(PAGES)
    for layer in range(3):
        assert torch.equal(values[layer, 0], source.k[layer][picked].index_select(1, index))
        assert torch.equal(values[layer, 1], source.v[layer][picked].index_select(1, index))
    target = _pool(fill=float("nan"))
    write_shard(target, PAGES, shard, picked)
    _assert_only(target, source, picked)


def test_rank_0s_own_heads_move_without_a_shard_and_touch_nothing_else() -> None:
    source, target = _pool(), _pool(fill=float("nan"))
    copy_heads(source, target, PAGES, slice(0, 2))
    _assert_only(target, source, slice(0, 2))
