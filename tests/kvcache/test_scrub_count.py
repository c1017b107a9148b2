"""I7, counted: `KVCacheManager.num_pages_scrubbed` is every page the scrub policy overwrote
(what /metrics exports as `kvseal_kv_pages_scrubbed_total` and the canary reports)."""

from __future__ import annotations

import pytest
import torch

from kvseal.config import CacheConfig
from kvseal.kvcache.manager import KVCacheManager
from kvseal.types import Request, SamplingParams

PAGE_SIZE = 4
NUM_LAYERS = 2


def manager(kv_scrub: str, check_kv: bool) -> KVCacheManager:
    config = CacheConfig(PAGE_SIZE, 8, torch.float32, kv_scrub, check_kv)  # type: ignore[arg-type]
    return KVCacheManager(config, NUM_LAYERS, num_kv_heads=1, head_dim=4)


# (reserve 3 pages, grow to 4, free them): the count after each step.
MODES = {
    "off": ("off", False, (0, 0, 0)),
    "free": ("free", False, (0, 0, 4)),  # zeroed when freed
    "alloc": ("alloc", False, (3, 4, 4)),  # zeroed when handed out
    "checked": ("off", True, (3, 4, 8)),  # zeroed when handed out, NaN when freed
    "checked-with-free": ("free", True, (3, 4, 8)),  # checked mode decides, whatever kv_scrub says
}


@pytest.mark.parametrize("mode", MODES)
def test_every_page_the_policy_overwrites_is_counted(mode: str) -> None:
    kv_scrub, check_kv, expected = MODES[mode]
    kv = manager(kv_scrub, check_kv)
    assert kv.num_pages_scrubbed == 0, "the start-up poison of checked mode is not a scrub"
    kv.reserve("a", "alice", 3 * PAGE_SIZE)
    after_reserve = kv.num_pages_scrubbed
    kv.reserve("a", "alice", 4 * PAGE_SIZE)
    after_growth = kv.num_pages_scrubbed
    kv.free("a")
    assert (after_reserve, after_growth, kv.num_pages_scrubbed) == expected


@pytest.mark.parametrize(("kv_scrub", "check_kv", "expected"), [("off", False, 0), ("free", False, 2),
                                                                ("alloc", False, 0), ("off", True, 2)])
def test_evicted_cached_pages_are_counted_as_freed_ones(kv_scrub: str, check_kv: bool, expected: int) -> None:
    """Pages go into the prefix cache unscrubbed; an eviction scrubs them as a free does (alloc
    mode zeroes them only when they are handed out again)."""
    kv = manager(kv_scrub, check_kv)
    request = Request("a", "alice", list(range(2 * PAGE_SIZE + 1)), SamplingParams())
    kv.reserve("a", "alice", request.num_tokens)
    for layer in range(NUM_LAYERS):
        kv.record_written("a", layer, 0, request.num_tokens)
    request.num_computed_tokens = request.num_tokens
    kv.publish_written(request)
    kv.free("a")  # its two full pages stay cached, its last page is freed
    assert kv.num_cached_pages == 2
    before_eviction = kv.num_pages_scrubbed
    assert kv.evict(2) and kv.num_cached_pages == 0
    assert kv.num_pages_scrubbed - before_eviction == expected
