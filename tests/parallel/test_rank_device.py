"""Where a tensor-parallel rank runs and which group carries its forward's collectives
(`parallel/rank_device.py`), in process: the choice, the refusals, and the CPU path's one gloo group."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvseal.config import EngineArgs
from kvseal.errors import ConfigError
from kvseal.parallel.group import GroupSpec, RankGroup
from kvseal.parallel.node import run_node
from kvseal.parallel.rank_device import CPU_RANK, RankDevice
from kvseal.parallel.tp_key import new_secret, write_tp_key


def test_the_cpu_keeps_the_forward_on_the_gloo_group() -> None:
    for local_rank in range(4):
        assert RankDevice.choose("cpu", local_rank, 4, num_visible_gpus=0) == CPU_RANK
    assert not CPU_RANK.has_forward_group and CPU_RANK.forward_backend == "gloo"


def test_cuda_gives_each_local_rank_its_own_gpu_and_an_nccl_group() -> None:
    chosen = [RankDevice.choose("cuda", r, 2, num_visible_gpus=4) for r in range(2)]
    assert [c.device for c in chosen] == ["cuda:0", "cuda:1"]
    assert all(c.forward_backend == "nccl" and c.has_forward_group for c in chosen)


@pytest.mark.parametrize("visible", [0, 1])
def test_fewer_gpus_than_local_ranks_is_a_config_error(visible: int) -> None:
    with pytest.raises(ConfigError, match=f"2 ranks on this node, one GPU each, and torch sees {visible} GPU"):
        RankDevice.choose("cuda", 0, 2, num_visible_gpus=visible)


def test_a_local_rank_outside_the_node_or_another_device_is_refused() -> None:
    with pytest.raises(ConfigError, match="outside this node's ranks 0..1"):
        RankDevice.choose("cpu", 2, 2, num_visible_gpus=0)
    with pytest.raises(ConfigError, match="cpu or cuda"):
        RankDevice.choose("mps", 0, 2, num_visible_gpus=0)


def test_tp_node_refuses_cuda_with_fewer_gpus_than_its_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before any rank starts (the model does not exist: nothing got that far)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    key = write_tp_key(tmp_path / "tp.key")
    flags = dict(model=str(tmp_path / "no-model"), tensor_parallel_size=4, nnodes=2, node_rank=1, master_port=29999,
                 tp_key_file=str(key), device="cuda")
    with pytest.raises(ConfigError, match="--kv-cache-tokens or --kv-cache-memory"):
        run_node(EngineArgs(**flags))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="NCCL cannot put two ranks on one GPU"):
        run_node(EngineArgs(**flags, kv_cache_tokens=64))  # type: ignore[arg-type]


def test_a_cpu_group_forms_no_second_group_and_reduces_over_gloo(tmp_path: Path) -> None:
    """One rank, in this process: `serving` on the CPU authenticates the gloo group and keeps the
    forward's collectives on it."""
    os.chmod(tmp_path, 0o700)
    group = RankGroup(GroupSpec("127.0.0.1", 0, 1, 10.0, store_path=str(tmp_path / "store")), 0, new_secret())
    try:
        group.serving(CPU_RANK)
        assert group.forward_backend == "gloo" and group.rank_device == CPU_RANK
        t = torch.arange(4, dtype=torch.float32)
        group.all_reduce(t)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
        assert group.gather_vocab(t[None]).shape == (1, 4)
    finally:
        group.close()
