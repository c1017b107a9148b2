"""`kvseal tp-node`: a node other than 0 of a multi-node tensor-parallel engine.

It runs no engine and no scheduler: it starts this node's worker ranks
(node_rank * ranks_per_node ..), which join rank 0 at --master-addr:--master-port, and waits
for them. Its pool size comes from the same flags as node 0's (the model's config.json only);
rank 0 refuses a rank whose page count differs from its own. Its ranks prove the key in
--tp-key-file (the same file as node 0's) before the group carries anything; without a key file,
or with one others may read, it refuses to start.

It does not rejoin by itself: once its ranks exit (one killed, or the group broken because a
rank elsewhere or node 0's engine failed) it logs how each ended and exits, and node 0's engine,
restarted by its own supervisor, waits for this node's ranks until its start timeout. Run it
under a supervisor that restarts it whatever its exit status (systemd `Restart=always`).
"""

from __future__ import annotations

import logging
import signal
import time
from types import FrameType

from kvseal.config import EngineArgs
from kvseal.errors import ConfigError
from kvseal.model_files import resolve_model_path
from kvseal.models.loader import plan_config
from kvseal.ops.device import resolve_device
from kvseal.parallel.driver import RankOptions, RankProcesses
from kvseal.parallel.group import GroupSpec
from kvseal.parallel.rank_device import RankDevice
from kvseal.parallel.tp_key import engine_secret

logger = logging.getLogger("kvseal")

POLL_S = 0.5


def run_node(args: EngineArgs) -> int:
    """Start this node's ranks and wait until every one exits; its exit status is the worst."""
    if args.node_rank == 0:
        raise ConfigError("tp-node runs the ranks of a node other than 0 (--node-rank 1..); node 0 runs the engine "
                          "(kvseal serve, kvseal generate, LLM(...)) with --nnodes and --master-port")
    key = engine_secret(args.tp_key_file, args.nnodes)  # before anything starts: a bad key file stops here
    device = resolve_device(args.device)
    args = args.on_device(device)  # as node 0's engine decides it: the same dtype and pool arithmetic
    if device == "cuda" and args.kv_cache_tokens is None and args.kv_cache_memory is None:
        raise ConfigError("tp-node on cuda needs the pool's size given (--kv-cache-tokens or --kv-cache-memory, the "
                          "same as node 0's): node 0 sizes a pool by its GPU's free memory, which this node cannot "
                          "know, and every rank must hold the same number of pages")
    RankDevice.here(device, 0, args.ranks_per_node)  # a GPU for every local rank, or ConfigError now
    path = resolve_model_path(args.model)
    cache, _ = args.resolve(plan_config(path))
    options = RankOptions(str(path), args.dtype, args.quantization, args.native, args.seed, args.num_threads,
                          cache.num_pages, cache.page_size, cache.check_kv, device, args.attention_backend)
    spec = GroupSpec(args.master_addr, args.master_port, args.tensor_parallel_size, args.tp_timeout_s)
    first = args.node_rank * args.ranks_per_node
    ranks = RankProcesses(options, spec, range(first, first + args.ranks_per_node), key, args.ranks_per_node)
    logger.info("tp-node %d: ranks %d..%d (pids %s) joining rank 0 at %s", args.node_rank, first,
                first + args.ranks_per_node - 1, ranks.pids, spec.address)
    stop = {"signal": 0}

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop["signal"] and any(p.poll() is None for p in ranks.procs):
        time.sleep(POLL_S)
    if stop["signal"]:
        ranks.kill()
    status = max((p.wait() for p in ranks.procs), default=0)
    ended = "; ".join(f"rank {rank} (pid {proc.pid}): {_exit_words(proc.returncode)}"
                      for rank, proc in zip(range(first, first + args.ranks_per_node), ranks.procs))
    if stop["signal"]:
        logger.info("tp-node %d: stopped by %s; its ranks ended (%s)", args.node_rank,
                    signal.Signals(stop["signal"]).name, ended)
    else:
        logger.error("tp-node %d: its ranks exited (%s): the tensor-parallel group is broken, and node 0's engine "
                     "stops with it. tp-node exits (status %d) and does not rejoin by itself: run it under a "
                     "supervisor that restarts it (systemd Restart=always), so its ranks join node 0's restarted "
                     "engine, which waits for them until its start timeout", args.node_rank, ended, status)
    return status


def _exit_words(returncode: int | None) -> str:
    """A rank process's end in words: 'exit code 1', 'killed by SIGKILL (signal 9)'."""
    if returncode is None or returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "an unknown signal"
    return f"killed by {name} (signal {-returncode})"
