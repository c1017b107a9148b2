"""`kvseal serve` in PD mode: the frontend over prefill and decode engines.

`--prefill A[,B] --decode C[,D]` uses running engines; `--pd` first starts one prefill and one
decode engine on loopback ports of this host (multiprocessing "spawn", so they exit with the
frontend) and stops them on the way out. The frontend loads no weights, only the tokenizer.

Keys (I9): with `--prefill/--decode` the frontend proves `--link-key` and expects each engine
to prove the public key given for it (`--prefill-keys`, `--decode-keys`, in address order).
`--pd` makes throw-away key pairs for itself and both engines at every start; an engine gets
its own pair and its allow-lists inside its `NodeConfig`, which multiprocessing hands over on
its private pipe (never in argv or the environment, which `ps` and /proc show).
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
from multiprocessing.process import BaseProcess
from pathlib import Path

from kvseal.config import EngineArgs
from kvseal.disagg.config import NodeConfig
from kvseal.disagg.engine_main import run_engine_process
from kvseal.disagg.frontend import PdClient
from kvseal.disagg.link_keys import EngineLinkKeys
from kvseal.disagg.topology import PdTopology
from kvseal.model_files import resolve_model_path
from kvseal.models.loader import convert_gguf

logger = logging.getLogger("kvseal.server")

STOP_TIMEOUT_S = 30.0


def tokenizer_folder(model: str | None) -> str:
    """The folder whose tokenizer the frontend loads (a GGUF is converted once, as engines do)."""
    path = resolve_model_path(model)
    return str(convert_gguf(path) if path.suffix == ".gguf" else Path(path))


class SpawnedEngines:
    """`--pd`: one prefill and one decode engine, children of the frontend process."""

    def __init__(self, topology: PdTopology, args: EngineArgs, ns: argparse.Namespace) -> None:
        ctx = multiprocessing.get_context("spawn")
        prefill_threads, decode_threads = topology.spawn_threads
        prefill_keys, decode_keys = spawned_link_keys(topology)
        configs = [NodeConfig("prefill", topology.prefill[0].address, ns.kv_transport, ns.reservation_timeout_s,
                              num_threads=prefill_threads, link_keys=prefill_keys),
                   NodeConfig("decode", topology.decode[0].address, ns.kv_transport, ns.reservation_timeout_s,
                              num_threads=decode_threads, link_keys=decode_keys)]
        log_level = getattr(ns, "log_level", "INFO")
        self.processes: list[BaseProcess] = [
            ctx.Process(target=run_engine_process, args=(args, config, log_level), name=f"kvseal-{config.role}",
                        daemon=False)
            for config in configs]
        for process in self.processes:
            process.start()
        logger.info("--pd: started prefill engine (pid %s) at %s with %d torch threads and decode engine (pid %s) "
                    "at %s with %d torch threads", self.processes[0].pid, topology.prefill[0].address,
                    prefill_threads, self.processes[1].pid, topology.decode[0].address, decode_threads)

    def stop(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                logger.error("engine %s did not stop within %g s; killing it", process.pid, STOP_TIMEOUT_S)
                process.kill()
                process.join()


def spawned_link_keys(topology: PdTopology) -> tuple[EngineLinkKeys, EngineLinkKeys]:
    """--pd: the prefill engine accepts the frontend; decode accepts the frontend and, as its one
    peer, the prefill engine."""
    assert topology.spawn_keys is not None, "--pd made the engines' keys"
    keys, frontend = topology.spawn_keys, topology.link_key.public_key()
    return (EngineLinkKeys(keys.prefill, (frontend,)),
            EngineLinkKeys(keys.decode, (frontend,), (keys.prefill.public_key(),)))


def start_pd_backend(topology: PdTopology, args: EngineArgs, ns: argparse.Namespace) -> PdClient:
    """The PD backend (and, for --pd, its engines, stopped by its `shutdown`); `start()` waits for them."""
    spawned = SpawnedEngines(topology, args, ns) if topology.spawn else None
    for endpoint in (*topology.prefill, *topology.decode):  # public keys: what an operator checks against
        logger.info("PD engine at %s must prove the public key %s", endpoint.address, endpoint.public_key.decode())
    return PdClient(list(topology.prefill), list(topology.decode), tokenizer_folder(args.model), topology.link_key,
                    spawned.stop if spawned is not None else lambda: None)
