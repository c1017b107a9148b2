"""A pool built ahead (`KVPool(touch_later=True)`, the CPU engine's, its memory committed while
the weights load) becomes the cache's only when it is the pool the cache describes and unused:
the cache's write records then observe its writes, and checked mode poisons it as a pool built
there."""

from __future__ import annotations

import pytest
import torch

from kvseal.config import CacheConfig
from kvseal.kvcache.manager import KVCacheManager
from kvseal.kvcache.pool import KVPool

PAGE_SIZE, NUM_PAGES, LAYERS, KV_HEADS, HEAD_DIM = 4, 8, 2, 1, 4


def _config(check_kv: bool) -> CacheConfig:
    return CacheConfig(PAGE_SIZE, NUM_PAGES, torch.float32, "off", check_kv)  # type: ignore[arg-type]


def _pool(**changes: int) -> KVPool:
    dims = {"num_layers": LAYERS, "num_pages": NUM_PAGES, "page_size": PAGE_SIZE, "num_kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM} | changes
    return KVPool(**dims, dtype=torch.float32, touch_later=True)


@pytest.mark.parametrize("check_kv", [False, True])
def test_the_cache_takes_the_pool_built_ahead_and_observes_its_writes(check_kv: bool) -> None:
    pool = _pool()
    kv = KVCacheManager(_config(check_kv), LAYERS, KV_HEADS, HEAD_DIM, pool=pool)
    assert kv.pool is pool and pool.observer is kv.records
    for tensor in pool.k + pool.v:  # checked mode: every slot NaN until written; else zero
        assert bool(tensor.isnan().all()) if check_kv else not tensor.any()


@pytest.mark.parametrize("changes", [{"num_pages": NUM_PAGES + 1}, {"num_layers": LAYERS + 1}, {"head_dim": 8}])
def test_a_pool_of_other_dimensions_is_refused(changes: dict[str, int]) -> None:
    with pytest.raises(ValueError, match="not this cache's"):
        KVCacheManager(_config(False), LAYERS, KV_HEADS, HEAD_DIM, pool=_pool(**changes))


def test_a_pool_already_observed_by_another_cache_is_refused() -> None:
    pool = _pool()
    KVCacheManager(_config(False), LAYERS, KV_HEADS, HEAD_DIM, pool=pool)
    with pytest.raises(ValueError, match="in use"):
        KVCacheManager(_config(False), LAYERS, KV_HEADS, HEAD_DIM, pool=pool)
