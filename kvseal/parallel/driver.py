"""Rank 0's side of tensor parallelism: start the worker ranks, send them each step, agree.

The engine keeps its one scheduler, allocator and ownership records; this driver starts ranks
1..N-1 (`python -m kvseal.parallel.worker`, each in a process group of its own, stopped by
PID), joins them in the torch.distributed group, and for every forward:

1. broadcasts a `StepMsg`: the ownership changes since the last step and the batch;
2. every rank checks the batch against its own records (rank 0: the engine's check), and the
   ranks all-gather their refusals: a sequence any rank refuses is refused on every rank;
3. only a batch no rank refused runs, on every rank, joined by the forward's collectives.

Any failed collective (a rank died, or hung past the timeout) raises `RankFailure`; the group is
then unusable and the engine fails closed.

The ranks' key (`tp_key.py`) reaches each worker on its stdin pipe, never its command line: the
spec on argv is not secret, and every rank proves the key as the group forms (`rank_auth.py`).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kvseal._testing.faults import Fault
from kvseal.errors import IsolationViolation
from kvseal.kvcache.manager import KVCacheManager
from kvseal.kvcache.records import ForwardWrites
from kvseal.parallel.group import GroupSpec, RankFailure, RankGroup, listen_for_ranks
from kvseal.parallel.msgs import (
    InjectFaultMsg,
    KeepAliveMsg,
    RankOptions,
    ReadyMsg,
    RefusalsMsg,
    StepMsg,
    StopMsg,
    WorkerSpecMsg,
    decode_from_rank,
    encode,
)
from kvseal.parallel.rank_device import CPU_RANK, RankDevice
from kvseal.parallel.tp_key import new_secret
from kvseal.types import ForwardBatch

logger = logging.getLogger("kvseal")

WORKER_MODULE = "kvseal.parallel.worker"
JOIN_POLL_S = 0.2  # how often rank 0 looks at its ranks while the group forms
STOP_WAIT_S = 10.0  # how long a stopping rank may take before it is killed
FAILED_STOP_WAIT_S = 1.0  # the same after the group failed (a rank may be hung: it never reads a stop)
RANK_WATCH_S = 0.5  # how often an idle rank 0 looks at this node's rank processes (one that exited fails the group)


@dataclass(frozen=True)
class RankPlacement:
    """Where the ranks are: how many, over how many nodes, where rank 0 listens, their timeout."""

    world_size: int
    nnodes: int
    master_addr: str
    master_port: int  # several nodes only (one node meets in a private file store)
    timeout_s: float

    @property
    def ranks_per_node(self) -> int:
        return self.world_size // self.nnodes


class RankProcesses:
    """The worker ranks' processes, each the leader of its own process group: stopped by PID."""

    def __init__(self, options: RankOptions, group: GroupSpec, ranks: range, key: bytes, ranks_per_node: int) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.first_rank = ranks.start
        for rank in ranks:
            spec = WorkerSpecMsg(options, rank, group.world_size, group.master_addr, group.master_port, group.timeout_s,
                                 group.store_path, ranks_per_node=ranks_per_node)
            proc = subprocess.Popen([sys.executable, "-m", WORKER_MODULE, encode(spec).hex()],
                                    stdin=subprocess.PIPE, start_new_session=True)
            self.procs.append(proc)
            _hand_over(proc, key)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Wait for each rank to exit, then kill what is left (its whole process group)."""
        for proc in self.procs:
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.wait()

    def exited(self) -> RankFailure | None:
        """The first of these ranks whose process has exited, as the group's failure; None while
        all run. (`poll` only: a stopped rank, one on another node, is the keep-alive's to find.)"""
        for rank, proc in enumerate(self.procs, start=self.first_rank):
            code = proc.poll()
            if code is not None:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return RankFailure(f"rank 0: tensor-parallel rank {rank} (pid {proc.pid}) {how}")
        return None

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                _kill_group(proc)
            proc.wait()


def _hand_over(proc: subprocess.Popen[bytes], key: bytes) -> None:
    """Write the key into the rank's stdin pipe and close it: readable by that process alone (its
    /proc/PID/fd is its user's, like its memory), where argv and the environment show in /proc."""
    assert proc.stdin is not None
    with contextlib.suppress(BrokenPipeError):  # the rank died at once: `_join_watching` sees it exit
        try:
            proc.stdin.write(key)  # 32 bytes: within the pipe's buffer, never blocks
        finally:
            proc.stdin.close()


def _join_watching(spec: GroupSpec, listener: socket.socket | None, ranks: RankProcesses, key: bytes) -> RankGroup:
    """Rank 0 joins the group (taking the socket over) while watching this node's ranks: one that
    exits before the group forms fails start-up at once, not after the start-up timeout."""
    joined: list[RankGroup | RankFailure] = []

    def join() -> None:
        try:
            joined.append(RankGroup(spec, 0, key, listener))
        except RankFailure as exc:
            joined.append(exc)
        except Exception as exc:  # after a failed start-up the store may still time out here: never unhandled
            joined.append(RankFailure(f"rank 0 could not join the tensor-parallel group at {spec.address}: {exc}"))

    thread = threading.Thread(target=join, name="kvseal-tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(JOIN_POLL_S)
        exited = [(p.pid, p.returncode) for p in ranks.procs if p.poll() is not None]
        if exited and thread.is_alive():
            raise RankFailure(f"tensor-parallel ranks exited before joining the group (pid, exit code): {exited}; "
                              f"their errors are in the log above")
    if isinstance(joined[0], RankFailure):
        raise joined[0]
    return joined[0]


def _meeting_place(place: RankPlacement) -> tuple[socket.socket | None, GroupSpec]:
    """Several nodes: the TCP store on rank 0's socket at master_addr:master_port, bound before any
    rank starts. One node: a file store in a folder of this user's alone (mkdtemp: 0700), so no
    other local user can rewrite the addresses the ranks connect to (and sit between two ranks)."""
    if place.nnodes > 1:
        listener = listen_for_ranks(place.master_addr, place.master_port)
        return listener, GroupSpec(place.master_addr, int(listener.getsockname()[1]), place.world_size,
                                   place.timeout_s)
    folder = tempfile.mkdtemp(prefix="kvseal-tp-")
    _STORE_FOLDERS.add(folder)
    return None, GroupSpec(place.master_addr, 0, place.world_size, place.timeout_s,
                           store_path=os.path.join(folder, "store"))


_STORE_FOLDERS: set[str] = set()  # this process's file stores not yet removed


def _remove_store(spec: GroupSpec) -> None:
    if spec.store_path is not None:
        folder = os.path.dirname(spec.store_path)
        shutil.rmtree(folder, ignore_errors=True)
        _STORE_FOLDERS.discard(folder)


@atexit.register
def _remove_stores_left() -> None:
    """A process that exits without closing its driver (`kvseal generate`, a failed engine)
    leaves no store folder behind; only a killed one does."""
    for folder in list(_STORE_FOLDERS):
        shutil.rmtree(folder, ignore_errors=True)
    _STORE_FOLDERS.clear()


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the rank's own group (start_new_session): it and its children
    except ProcessLookupError:
        pass


class TensorParallelDriver:
    """Rank 0 of a tensor-parallel engine: the one caller of the collectives' message side."""

    def __init__(self, group: RankGroup, ranks: RankProcesses, kv: KVCacheManager) -> None:
        self.group, self.ranks, self.kv = group, ranks, kv
        self.ready: list[ReadyMsg] = []
        # One caller of the group at a time: the engine's step (`exclusive`) or the keep-alive
        # thread, which speaks only while the engine is idle.
        self._lock = threading.Lock()
        self._last_sent = time.monotonic()
        self.failure: RankFailure | None = None  # the first failed collective, from either caller
        self._stopped = threading.Event()
        self._keep_alive: threading.Thread | None = None

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the group for one engine step (its messages and its forward's collectives)."""
        with self._lock:
            try:
                yield
            except RankFailure as exc:
                self.failure = self.failure or exc
                raise
            finally:
                self._last_sent = time.monotonic()

    def raise_if_failed(self) -> None:
        """RankFailure if a collective failed since start (also one of an idle engine's keep-alives)."""
        if self.failure is not None:
            raise self.failure

    def _keep_alive_loop(self) -> None:
        """While the engine is idle: every RANK_WATCH_S, a rank process of this node that exited
        fails the group at once (`/health` 503 within a second of a killed rank, not a keep-alive
        interval later); every timeout_s / 4, a keep-alive message finds a hung rank, or one on
        another node, within the collective's own bound."""
        interval_s = self.group.spec.timeout_s / 4
        while not self._stopped.wait(min(interval_s / 2, RANK_WATCH_S)):
            with self._lock:
                if self._stopped.is_set() or self.failure is not None or not self.group.is_open:
                    return
                exited = self.ranks.exited()
                if exited is not None:
                    logger.error("tensor-parallel rank watch: %s", exited)
                    self.failure = exited
                    return
                if time.monotonic() - self._last_sent < interval_s:
                    continue
                try:
                    self.group.broadcast_bytes(encode(KeepAliveMsg()))
                except RankFailure as exc:
                    logger.error("tensor-parallel keep-alive: %s", exc)
                    self.failure = exc
                    return
                self._last_sent = time.monotonic()

    @classmethod
    def start(cls, options: RankOptions, place: RankPlacement, kv: KVCacheManager,
              key: bytes | None = None) -> tuple[TensorParallelDriver, RankGroup]:
        """Start this node's ranks 1..ranks_per_node-1 and join every rank (rank 0: this process;
        other nodes' ranks come from their `kvseal tp-node`), each proving `key` (None: a fresh one,
        one node only). The caller loads its own shard, gives it the group, then calls `wait_ready`."""
        if key is None and place.nnodes > 1:
            raise RankFailure("ranks on several nodes share the operator's key (--tp-key-file); none was given")
        key = key if key is not None else new_secret()
        listener, spec = _meeting_place(place)
        ranks = RankProcesses(options, spec, range(1, place.ranks_per_node), key, place.ranks_per_node)
        try:
            group = _join_watching(spec, listener, ranks, key)
        except RankFailure:
            ranks.kill()
            _remove_store(spec)
            raise
        return cls(group, ranks, kv), group

    def wait_ready(self, pool_bytes: int, num_kv_heads: int, device: RankDevice = CPU_RANK) -> list[ReadyMsg]:
        """Every rank's shard is loaded; their pools, rank order (rank 0's from the caller). Rank 0's
        forward runs on `device` (the workers chose theirs of the same kind)."""
        mine = ReadyMsg(0, num_kv_heads, self.kv.config.num_pages, pool_bytes)
        answers = [decode_from_rank(a) for a in self.group.all_gather_bytes(encode(mine))]
        self.ready = [a for a in answers if isinstance(a, ReadyMsg)]
        self.group.serving(device)
        differ = [r.rank for r in self.ready if r.num_pages != mine.num_pages]
        if differ:  # page ids name the same page on every rank, or ownership means nothing
            raise RankFailure(f"ranks {differ} allocated another number of KV pages than rank 0's "
                              f"{mine.num_pages}: start every node with the same engine flags and model (a PD role's "
                              f"node 0 sizes its pool with rank 0's staging pool: pass --pd-role to every "
                              f"kvseal tp-node)")
        self._keep_alive = threading.Thread(target=self._keep_alive_loop, name="kvseal-tp-keep-alive", daemon=True)
        self._keep_alive.start()
        return self.ready

    def agree(self, batch: ForwardBatch, writes: ForwardWrites, starts: list[int],
              violations: list[IsolationViolation]) -> list[IsolationViolation]:
        """Send the step to every rank and gather every rank's refusals (rank 0's: `violations`).
        Returns every violation; empty: every rank runs this batch next (`run`)."""
        msg = StepMsg(self.kv.drain_events(), batch.input_ids.tolist(), batch.positions.tolist(),
                      batch.slot_mapping.tolist(), list(batch.query_lens), list(batch.context_lens),
                      [t.tolist() for t in batch.block_tables], batch.logits_indices.tolist(),
                      list(writes.request_ids), starts)
        self.group.broadcast_bytes(encode(msg))
        mine = {writes.request_ids.index(v.request_id): str(v) for v in violations}
        answers = [decode_from_rank(a) for a in self.group.all_gather_bytes(encode(RefusalsMsg(mine)))]
        found = {v.request_id: v for v in violations}
        for rank, answer in enumerate(answers):
            if not isinstance(answer, RefusalsMsg):
                continue
            for index, why in sorted(answer.refused.items()):
                request_id = writes.request_ids[index]
                found.setdefault(request_id, IsolationViolation(request_id, f"on tensor-parallel rank {rank}: {why}"))
        return list(found.values())

    def inject_fault_on_rank(self, rank: int, fault: Fault, active: bool = True) -> None:
        """Test-only: switch a `kvseal._testing` fault on (or off) in worker `rank` alone."""
        with self.exclusive():
            self.group.broadcast_bytes(encode(InjectFaultMsg(rank, fault.value, active)))

    def close(self) -> None:
        """Tell the ranks to stop, leave the group, and wait for them (killed past the wait)."""
        self._stopped.set()
        if self._keep_alive is not None:
            self._keep_alive.join()
        told = self.group.is_open
        if told:
            try:
                self.group.broadcast_bytes(encode(StopMsg()))
            except RankFailure as exc:
                logger.warning("stopping the tensor-parallel ranks: %s", exc)
                told = False
        self.group.close()
        self.ranks.stop(STOP_WAIT_S if told else FAILED_STOP_WAIT_S)
        _remove_store(self.group.spec)
