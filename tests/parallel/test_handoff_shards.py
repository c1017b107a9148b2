"""The byte shards a PD handoff moves between tensor-parallel ranks (`parallel/handoff.py`): a
rank's heads of exactly the given pages, read straight from its pool, padded with zero heads
(never with whatever memory held), and written back into exactly those pages and heads."""

from __future__ import annotations

import pytest
import torch

from kvseal.kvcache.pool import KVPool
from kvseal.parallel.handoff import shard_bytes, write_shard


def _pool(heads: int, fill: float | None = None) -> KVPool:
    pool = KVPool(3, 6, 4, heads, 8, torch.bfloat16)
    for layer, (k, v) in enumerate(zip(pool.k, pool.v)):
        if fill is None:
            k.copy_(torch.randn(k.shape, generator=torch.Generator().manual_seed(layer)))
            v.copy_(torch.randn(v.shape, generator=torch.Generator().manual_seed(100 + layer)))
        else:
            k.fill_(fill)
            v.fill_(fill)
    return pool


@pytest.mark.parametrize("heads", [None, slice(1, 3), slice(2, 3)])
def test_a_shard_holds_exactly_its_pages_and_heads_and_zero_padding(heads: slice | None) -> None:
    source = _pool(3)
    pages = [4, 1, 3]  # out of order: the shard follows the list
    shard = shard_bytes(source, pages, 3, heads)
    values = shard.view(torch.bfloat16).view(3, 2, 3, len(pages), 4, 8)
    picked = heads or slice(0, 3)
    count = picked.stop - picked.start
    index = torch.tensor(pages)
    for layer in range(3):
        assert torch.equal(values[layer, 0, :count], source.k[layer][picked].index_select(1, index))
        assert torch.equal(values[layer, 1, :count], source.v[layer][picked].index_select(1, index))
    assert not values[:, :, count:].any(), "padding heads carry zeros only"

    target = _pool(3, fill=float("nan"))
    write_shard(target, pages, shard, picked)
    others = [p for p in range(6) if p not in pages]
    for layer in range(3):
        for mine, theirs in ((target.k[layer], source.k[layer]), (target.v[layer], source.v[layer])):
            assert torch.equal(mine[picked][:, pages], theirs[picked][:, pages])
            assert mine[:, others].isnan().all(), "a page outside the list was written"
            rest = [h for h in range(3) if not picked.start <= h < picked.stop]
            assert mine[rest].isnan().all(), "a head outside the slice was written"
