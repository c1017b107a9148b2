"""Multi-node tensor parallelism over torch.distributed's own rendezvous, on one machine: node 0
is the engine (rank 0), node 1 a `kvseal tp-node` process (rank 1), meeting over loopback."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from processes import free_port, kvseal_argv
from tiny_models import make_tiny_model

from kvseal import LLM, SamplingParams
from kvseal.cli import build_parser, tp_node_args
from kvseal.config import CacheConfig, EngineArgs
from kvseal.errors import ConfigError
from kvseal.kvcache.manager import KVCacheManager
from kvseal.models.loader import plan_config
from kvseal.parallel.driver import RankOptions, RankPlacement, TensorParallelDriver
from kvseal.parallel.group import RankFailure, listen_for_ranks
from kvseal.parallel.tp_key import write_tp_key

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [list(range(10, 17)), list(range(30, 60))]
ENGINE = dict(kv_cache_tokens=256, max_model_len=64, page_size=4, dtype="float32")
FLAGS = ["--kv-cache-tokens", "256", "--max-model-len", "64", "--page-size", "4", "--dtype", "float32"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("nodes") / "llama")


@pytest.fixture
def tp_key(tmp_path: Path) -> Path:
    return write_tp_key(tmp_path / "tp.key")


@pytest.fixture
def node_1(model: Path, tp_key: Path) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    port = free_port()
    argv = kvseal_argv(["tp-node", str(model), "-tp", "2", "--nnodes", "2", "--node-rank", "1",
                        "--master-addr", "127.0.0.1", "--master-port", str(port), "--tp-key-file", str(tp_key),
                        *FLAGS])
    proc = subprocess.Popen(argv, start_new_session=True)
    yield proc, port
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=60)


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, /proc/net/tcp's form) listening on `port`."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.split(":")[1], 16) == port:
                found.append(local.split(":")[0])
    return found


def test_two_nodes_over_loopback_generate_what_one_process_does(
        model: Path, node_1: tuple[subprocess.Popen[bytes], int], tp_key: Path) -> None:
    proc, port = node_1
    expected = [o.token_ids for o in LLM(str(model), **ENGINE).generate(PROMPTS, GREEDY)]
    llm = LLM(str(model), tensor_parallel_size=2, nnodes=2, node_rank=0, master_port=port, tp_key_file=str(tp_key),
              **ENGINE)
    try:
        assert _listeners(port) == ["0100007F"], "rank 0 listens on 127.0.0.1 only, never a wildcard"
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == expected
        assert llm.engine.driver is not None and llm.engine.driver.ranks.pids == []  # rank 1 is node 1's
    finally:
        llm.engine.close()
    assert proc.wait(timeout=60) == 0, "node 1 exits when the engine stops its rank"


def test_node_flags_are_checked() -> None:
    with pytest.raises(ConfigError, match="--master-port"):
        LLM(None, tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ConfigError, match="divides"):
        LLM(None, tensor_parallel_size=3, nnodes=2, master_port=1234)
    for wildcard in ("0.0.0.0", "::", "*", "0", "0.0", "0x0", "000.000.000.000", "::0"):  # every spelling binds *
        with pytest.raises(ConfigError, match="wildcard"):
            LLM(None, tensor_parallel_size=2, master_addr=wildcard)
    with pytest.raises(ConfigError, match="tp-node"):
        LLM(None, tensor_parallel_size=2, nnodes=2, node_rank=1, master_port=1234, tp_key_file="unused")
    with pytest.raises(ConfigError, match="--tp-key-file"):
        LLM(None, tensor_parallel_size=2, nnodes=2, master_port=1234)


def test_kvseal_generate_takes_tp(model: Path) -> None:
    """`kvseal generate -tp 2` prints what `kvseal generate` does (vLLM's flag name)."""
    texts = []
    for extra in ([], ["-tp", "2"]):
        argv = kvseal_argv(["generate", "--model", str(model), "w5 w6 w7", "--max-tokens", "6", *FLAGS, *extra])
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        texts.append(done.stdout.strip().splitlines()[-1])
    assert texts[0] == texts[1] and texts[0]


def test_a_rank_that_cannot_load_its_shard_fails_start_up(tmp_path: Path) -> None:
    """The worker joins, then fails to load: rank 0's wait for it fails at once (its socket
    closed), not after the start-up timeout, and the rank is gone."""
    kv = KVCacheManager(CacheConfig(4, 8, torch.float32), num_layers=2, num_kv_heads=1, head_dim=16, mirrored=True)
    options = RankOptions(str(tmp_path / "no-such-model"), "float32", "none", "off", 0, 1, 8, 4, False)
    driver, _ = TensorParallelDriver.start(options, RankPlacement(2, 1, "127.0.0.1", 0, 20.0), kv)
    try:
        with pytest.raises(RankFailure):
            driver.wait_ready(kv.pool.num_bytes, 1)
    finally:
        driver.close()
    assert all(p.poll() is not None for p in driver.ranks.procs)


def test_a_rank_that_exits_before_joining_fails_start_up_at_once(monkeypatch: pytest.MonkeyPatch,
                                                                 model: Path) -> None:
    """Not after the start-up timeout (300 s): rank 0 watches its ranks while the group forms.
    And the failed start leaves nothing behind: the next tensor-parallel engine in the same
    process starts and serves (a rank 0 that had entered torch.distributed's group set-up would
    have advanced its group counter, and its next group would never meet its fresh workers')."""
    import kvseal.parallel.driver as driver_module

    monkeypatch.setattr(driver_module, "WORKER_MODULE", "kvseal.parallel.no_such_module")
    kv = KVCacheManager(CacheConfig(4, 8, torch.float32), num_layers=2, num_kv_heads=1, head_dim=16, mirrored=True)
    options = RankOptions("unused", "float32", "none", "off", 0, 1, 8, 4, False)
    with pytest.raises(RankFailure, match="exited before joining"):
        TensorParallelDriver.start(options, RankPlacement(2, 1, "127.0.0.1", 0, 20.0), kv)
    monkeypatch.undo()
    llm = LLM(str(model), tensor_parallel_size=2, tp_timeout_s=60.0, **ENGINE)  # type: ignore[arg-type]
    try:
        assert len(llm.generate(PROMPTS[:1], GREEDY)[0].token_ids) == GREEDY.max_tokens
    finally:
        llm.engine.close()


def test_a_tp_node_of_a_pd_role_sizes_its_pool_as_node_0_does(model: Path, tp_key: Path) -> None:
    """Node 0 of a PD role's TP engine sizes its pool with rank 0's staging pool inside the KV
    memory; `kvseal tp-node --pd-role` resolves the same number of pages (without it, fewer pages
    on node 0 than on node 1, which the driver refuses at start)."""
    memory = ["--kv-cache-memory", "300KiB", "--max-model-len", "64", "--page-size", "4", "--dtype", "float32"]
    argv = ["tp-node", str(model), "-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-port", "1234",
            "--tp-key-file", str(tp_key), *memory]
    config = plan_config(model)
    node_0 = EngineArgs(model=str(model), tensor_parallel_size=2, kv_cache_memory="300KiB", max_model_len=64,
                        page_size=4, dtype="float32", pd_role=True)
    pages = node_0.on_device("cpu").resolve(config)[0].num_pages  # as the engine and run_node resolve them

    def node_1_pages(*flags: str) -> int:
        return tp_node_args(build_parser().parse_args([*argv, *flags])).on_device("cpu").resolve(config)[0].num_pages

    assert node_1_pages("--pd-role") == pages
    assert node_1_pages() > pages


def test_rank_0_never_listens_on_the_any_address_whatever_names_it() -> None:
    """Past the flag check (a host name that stands for the any-address), the bound socket itself is checked."""
    with pytest.raises(RankFailure, match="any-address"):
        listen_for_ranks("0", 0)
    listener = listen_for_ranks("127.0.0.1", 0)
    listener.close()
