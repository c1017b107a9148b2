"""`kvseal serve` in PD mode: the frontend over prefill and decode engines.

`--prefill A[,B] --decode C[,D]` uses running engines; `--pd` first starts one prefill and one
decode engine on loopback ports of this host (multiprocessing "spawn", so they exit with the
frontend) and stops them on the way out. The frontend loads no weights, only the tokenizer.

`--pd` supervises the engines it started (`kvseal.engine.supervisor`): one that dies is reaped
at once (no `<defunct>` child) with its exit logged, and started again at the same address with
the same keys after the policy's backoff, up to its limit. The frontend notices the death on its
own link (its requests fail with errors, /health 503 while a role has no engine) and uses the
new instance as soon as it introduces itself, as it does for external engines that come back.

Keys (I9): with `--prefill/--decode` the frontend proves `--link-key` and expects each engine
to prove the public key given for it (`--prefill-keys`, `--decode-keys`, in address order).
`--pd` makes throw-away key pairs for itself and both engines at every start; an engine gets
its own pair and its allow-lists inside its `NodeConfig`, which multiprocessing hands over on
its private pipe (never in argv or the environment, which `ps` and /proc show).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from multiprocessing.process import BaseProcess
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter

from kvseal.config import EngineArgs
from kvseal.disagg.config import NodeConfig
from kvseal.disagg.engine_main import run_engine_process
from kvseal.disagg.frontend import PdClient
from kvseal.disagg.link_keys import EngineLinkKeys
from kvseal.disagg.topology import PdTopology
from kvseal.engine.supervisor import RestartPolicy, RestartTracker, describe_exit, restarted, spawn_context
from kvseal.model_files import resolve_model_path
from kvseal.models.loader import convert_gguf

logger = logging.getLogger("kvseal.server")

STOP_TIMEOUT_S = 30.0
WATCH_INTERVAL_S = 0.1  # how often the supervisor looks for engines that ended


def tokenizer_folder(model: str | None, tokenizer: str | None = None) -> str:
    """The folder whose tokenizer the frontend loads: `--tokenizer`'s, else the model's (a GGUF
    is converted once, as engines do)."""
    if tokenizer is not None:
        return tokenizer
    path = resolve_model_path(model)
    return str(convert_gguf(path) if path.suffix == ".gguf" else Path(path))


class SpawnedEngines:
    """`--pd`: one prefill and one decode engine, children of the frontend process."""

    def __init__(self, topology: PdTopology, args: EngineArgs, ns: argparse.Namespace,
                 restart: RestartPolicy | None = None) -> None:
        """`restart` None: never restarted (`supervise` still reaps and logs an engine that dies)."""
        prefill_threads, decode_threads = topology.spawn_threads
        prefill_keys, decode_keys = spawned_link_keys(topology)
        self._args = args
        self._configs = [
            NodeConfig("prefill", topology.prefill[0].address, ns.kv_transport, ns.reservation_timeout_s,
                       num_threads=prefill_threads, link_keys=prefill_keys),
            NodeConfig("decode", topology.decode[0].address, ns.kv_transport, ns.reservation_timeout_s,
                       num_threads=decode_threads, link_keys=decode_keys)]
        self._log_level = getattr(ns, "log_level", "INFO")
        policy = restart or RestartPolicy(engine_restart_limit=0)
        self._trackers = [RestartTracker(policy) for _ in self._configs]
        self._restart_at_s: list[float | None] = [None for _ in self._configs]  # monotonic time of a due restart
        self._is_given_up = [False for _ in self._configs]
        self._last_event: list[str | None] = [None for _ in self._configs]  # for `why_down`
        self._exit_why = ["" for _ in self._configs]
        self._is_stopping = False
        self._task: asyncio.Task[None] | None = None
        self._restarts_total: Counter | None = None
        self.processes: list[BaseProcess] = [self._spawn(config) for config in self._configs]
        logger.info("--pd: started prefill engine (pid %s) at %s with %d torch threads and decode engine (pid %s) "
                    "at %s with %d torch threads", self.processes[0].pid, topology.prefill[0].address,
                    prefill_threads, self.processes[1].pid, topology.decode[0].address, decode_threads)

    def _spawn(self, config: NodeConfig) -> BaseProcess:
        ctx = spawn_context()
        process = ctx.Process(target=run_engine_process, args=(self._args, config, self._log_level),
                              name=f"kvseal-{config.role}", daemon=False)
        process.start()
        return process

    def add_metrics(self, registry: CollectorRegistry) -> None:
        self._restarts_total = Counter("kvseal_engine_restarts", "Engine processes restarted after they died",
                                       ["role"], registry=registry)
        for config in self._configs:
            self._restarts_total.labels(role=config.role)

    def supervise(self) -> None:
        """Watch the engines from the running event loop until `stop`."""
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while not self._is_stopping:
            for index in range(len(self.processes)):
                self._check(index)
            await asyncio.sleep(WATCH_INTERVAL_S)

    def _check(self, index: int) -> None:
        """Reap an engine that ended and plan its restart; start it when that is due."""
        process, config, tracker = self.processes[index], self._configs[index], self._trackers[index]
        due_s = self._restart_at_s[index]
        if due_s is not None:
            if time.monotonic() >= due_s:
                self._restart(index)
            return
        if self._is_given_up[index] or process.exitcode is None:
            return  # alive, or ended and not to be restarted
        process.join()  # reaped: no <defunct> child
        why = _exited(config.role, process)
        logged = (f"the {config.role} engine (pid {process.pid}) at {config.listen} exited "
                  f"({describe_exit(process.exitcode)})")  # the log names the process; clients get `why`
        delay_s = tracker.next_delay_s()
        if delay_s is None:
            then = tracker.gave_up()
            self._last_event[index] = f"{why}; {then}"
            logger.critical("%s; %s", logged, then)
            self._is_given_up[index] = True
            return
        self._exit_why[index] = why
        self._last_event[index] = f"{why}; restarting it in {delay_s:g} s"
        logger.error("%s; restarting it in %g s (restart %d in a row, at most %d)", logged, delay_s,
                     tracker.num_in_a_row, tracker.policy.engine_restart_limit)
        self._restart_at_s[index] = time.monotonic() + delay_s

    def why_down(self, role: str) -> str | None:
        """What clients are told of the `role` engine as it is now, if it ever exited (the frontend
        asks while no `role` engine answers): no PID or address, those are in the log. An engine
        that exited and is not reaped yet is described as exited, never by the restart before."""
        index = next(i for i, config in enumerate(self._configs) if config.role == role)
        process = self.processes[index]
        is_reaped = self._restart_at_s[index] is not None or self._is_given_up[index]
        if process.exitcode is not None and not is_reaped and not self._is_stopping:
            return _exited(role, process)
        return self._last_event[index]

    def answered(self, role: str) -> None:
        """The `role` engine introduced itself to the frontend: "restarted ..., waiting for it to
        answer" is over. Should it go down again while its process lives (hung, disconnected),
        the frontend's own reason is what clients get, not this restart's story."""
        index = next(i for i, config in enumerate(self._configs) if config.role == role)
        if self.processes[index].exitcode is None and self._restart_at_s[index] is None:
            self._last_event[index] = None

    def _restart(self, index: int) -> None:
        self._restart_at_s[index] = None
        self.processes[index] = self._spawn(self._configs[index])
        self._last_event[index] = restarted(self._exit_why[index])
        self._trackers[index].started()
        if self._restarts_total is not None:
            self._restarts_total.labels(role=self._configs[index].role).inc()
        logger.warning("restarted the %s engine at %s (pid %s)", self._configs[index].role,
                       self._configs[index].listen, self.processes[index].pid)

    def stop(self) -> None:
        self._is_stopping = True
        if self._task is not None:
            self._task.cancel()
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        for process in self.processes:
            process.join(STOP_TIMEOUT_S)
            if process.is_alive():
                logger.error("engine %s did not stop within %g s; killing it", process.pid, STOP_TIMEOUT_S)
                process.kill()
                process.join()


def _exited(role: str, process: BaseProcess) -> str:
    """An engine's exit, as clients are told it."""
    return f"the {role} engine exited ({describe_exit(process.exitcode)})"


def spawned_link_keys(topology: PdTopology) -> tuple[EngineLinkKeys, EngineLinkKeys]:
    """--pd: the prefill engine accepts the frontend; decode accepts the frontend and, as its one
    peer, the prefill engine."""
    assert topology.spawn_keys is not None, "--pd made the engines' keys"
    keys, frontend = topology.spawn_keys, topology.link_key.public_key()
    return (EngineLinkKeys(keys.prefill, (frontend,)),
            EngineLinkKeys(keys.decode, (frontend,), (keys.prefill.public_key(),)))


def start_pd_backend(topology: PdTopology, args: EngineArgs, ns: argparse.Namespace,
                     restart: RestartPolicy | None = None) -> PdClient:
    """The PD backend (and, for --pd, its engines, supervised under `restart` from the running
    event loop and stopped by its `shutdown`); `start()` waits for them."""
    spawned = SpawnedEngines(topology, args, ns, restart) if topology.spawn else None
    if spawned is not None:
        spawned.supervise()
    for endpoint in (*topology.prefill, *topology.decode):  # public keys: what an operator checks against
        logger.info("PD engine at %s must prove the public key %s", endpoint.address, endpoint.public_key.decode())
    return PdClient(list(topology.prefill), list(topology.decode), tokenizer_folder(args.model, args.tokenizer),
                    topology.link_key, spawned)
