"""The always-on check (I3, I4) as batched tensor ops on the pool's device, read back once per
step: the same refusals on every device. Here on CPU tensors; the `gpu`-marked tests run the
isolation fault tests (the fault switches show each check failing when what it guards is broken)
with the pool, the records and the check on CUDA, and count the check's host round trips."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import test_isolation_checks as iso  # the fault tests, run once more on CUDA below
import torch
from test_write_records import NUM_LAYERS, PAGE_SIZE, prepare, write_layers

from kvseal.config import CacheConfig
from kvseal.engine.batch import check_forward
from kvseal.kvcache.manager import KVCacheManager


def _kv(device: str) -> KVCacheManager:
    config = CacheConfig(page_size=PAGE_SIZE, num_pages=8, dtype=torch.float32, device=device)
    return KVCacheManager(config, NUM_LAYERS, num_kv_heads=1, head_dim=2)


def _mixed_batch_refusals(device: str) -> dict[str, str]:
    """One batch: a clean sequence, one whose table names another's page, one reading KV no
    layer wrote, one holding no pages. Each refused for its own reason; the clean one not."""
    kv = _kv(device)
    for request_id in ("clean", "thief", "victim", "short"):
        kv.reserve(request_id, request_id, 8)
    write_layers(kv, prepare(kv, {"clean": (0, 4), "thief": (0, 4), "victim": (0, 4)}), range(NUM_LAYERS))
    prepared = prepare(kv, {"clean": (4, 5), "thief": (4, 5), "short": (4, 5)})  # short never wrote [0, 4)
    prepared.batch.block_tables[1][0] = kv.allocator.pages_of("victim")[0]  # thief's table names victim's page
    refusals = {v.request_id: str(v) for v in check_forward(prepared, kv)}
    orphan = prepare(kv, {"clean": (4, 5)})
    kv.free("clean")  # the batch was built while it held pages; now it holds none
    orphan = dataclasses.replace(orphan, writes=kv.plan_writes(["clean"], [4], [5]))
    return refusals | {v.request_id + "/orphan": str(v) for v in check_forward(orphan, kv)}


def test_each_sequence_of_a_batch_is_refused_for_its_own_reason_on_cpu() -> None:
    refusals = _mixed_batch_refusals("cpu")
    assert set(refusals) == {"thief", "short", "clean/orphan"}
    assert f"pages [{refusals['thief'].split('[')[1].split(']')[0]}] it does not own" in refusals["thief"]
    assert "layer 0 holds KV for [0, 0)" in refusals["short"] and "never wrote" in refusals["short"]
    assert "holds no KV pages" in refusals["clean/orphan"]


@pytest.mark.gpu
def test_the_check_refuses_the_same_on_cuda() -> None:
    assert _mixed_batch_refusals("cuda") == _mixed_batch_refusals("cpu")


@pytest.mark.gpu
def test_a_clean_step_check_reads_back_once_on_cuda() -> None:
    kv = _kv("cuda")
    for request_id in ("a", "b"):
        kv.reserve(request_id, request_id, 8)
    write_layers(kv, prepare(kv, {"a": (0, 4), "b": (0, 3)}), range(NUM_LAYERS))
    prepared = prepare(kv, {"a": (4, 5), "b": (3, 4)})
    batch = dataclasses.replace(prepared.batch, slot_mapping=prepared.batch.slot_mapping.cuda())
    prepared = dataclasses.replace(prepared, batch=batch)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            assert check_forward(prepared, kv) == []
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


@pytest.fixture
def cuda_llm(make_llm: Callable[..., Any]) -> Callable[..., Any]:
    return lambda **kwargs: make_llm(device="cuda", **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("fault_test", [
    iso.test_placeholder_fault_leaks_without_checks,
    iso.test_default_config_catches_the_placeholder_fault,
    iso.test_checked_mode_catches_the_placeholder_fault,
    iso.test_scrub_free_removes_the_dependency_on_earlier_tenants,
    iso.test_foreign_page_fault_leaks_without_checks,
    iso.test_bypass_switches_off_checked_mode_too,
], ids=lambda f: f.__name__.removeprefix("test_"))
def test_the_isolation_fault_tests_on_cuda(fault_test: Callable[..., None], cuda_llm: Callable[..., Any]) -> None:
    fault_test(cuda_llm)


@pytest.mark.gpu
@pytest.mark.parametrize("check_kv", [False, True], ids=["default", "checked"])
def test_a_foreign_page_is_refused_on_cuda(check_kv: bool, cuda_llm: Callable[..., Any]) -> None:
    iso.test_a_foreign_page_is_refused(cuda_llm, check_kv)
