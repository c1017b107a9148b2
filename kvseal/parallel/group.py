"""The ranks' process groups: torch.distributed, and typed messages over it.

Rank 0 is the engine (the driver: scheduler, allocator and page ownership live there); ranks
1..N-1 are workers. Everything between them goes through one gloo group on the CPU: the driver's
step messages (msgspec bytes broadcast from rank 0; never pickle), the refusals, a handoff's
shards, and on the CPU the forward's collectives too. On CUDA the forward's collectives go
through a second group, nccl on each rank's GPU (`rank_device.RankDevice`), formed once the gloo
group is authenticated and authenticated itself before it carries anything.
Every gloo collective is bounded by the group's timeout: a rank that died fails the next
collective at once (its sockets close), a rank that hangs fails it after `timeout_s`; either
way the caller gets `RankFailure` and the engine fails closed. An nccl collective runs
asynchronously on the GPU: past the same timeout torch's NCCL watchdog aborts it and ends the
process (its default error handling), which the driver and the frontend see as a rank, or the
engine, gone.

Every group is authenticated as it forms, before it carries anything (`rank_auth.py`): each rank
proves it holds the engine's key (`tp_key.py`) to every other rank, or the group is refused.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kvseal._testing.faults import Fault, is_active
from kvseal.errors import KvsealError
from kvseal.parallel.rank_auth import NONCE_BYTES, TAG_BYTES, new_nonce, refused_ranks, tag_of
from kvseal.parallel.rank_device import CPU_RANK, RankDevice

logger = logging.getLogger("kvseal.parallel")

START_TIMEOUT_S = 300.0  # joining the group and loading a shard, every rank


class RankFailure(KvsealError):
    """A collective did not complete: a rank died, hung past the timeout, or the group is gone.
    The group cannot be used again; the engine stops and fails every request it holds."""


@dataclass(frozen=True)
class GroupSpec:
    """Where and how the ranks meet. Several nodes: torch.distributed's TCP store on rank 0's node
    at master_addr:master_port (127.0.0.1 unless the user names another address; never a
    wildcard). One node (`store_path`): a file store in rank 0's private folder (0700), so no other
    user can read or write the addresses the ranks connect to, and none can get between them."""

    master_addr: str
    master_port: int
    world_size: int
    timeout_s: float  # a collective's bound once every rank is loaded (`RankGroup.serving`)
    backend: str = "gloo"
    store_path: str | None = None

    @property
    def address(self) -> str:
        return self.store_path if self.store_path is not None else f"{self.master_addr}:{self.master_port}"

    @property
    def start_timeout_s(self) -> float:
        """The bound while ranks start and load their shards (slower than any step)."""
        return max(self.timeout_s, START_TIMEOUT_S)


class RankGroup:
    """This process's membership in the group: the forward's collectives and the message channel."""

    def __init__(self, spec: GroupSpec, rank: int, key: bytes, listener: socket.socket | None = None) -> None:
        """Join the group as `rank` and prove `key` to every other rank (and they to this one), or
        RankFailure; rank 0 serves the store on `listener` (bound by the caller to
        master_addr:master_port, so torch binds nothing of its own there), which it takes over."""
        self.rank, self.world_size, self.spec = rank, spec.world_size, spec
        self._key = key  # until `serving` has authenticated the serving group too
        start = datetime.timedelta(seconds=spec.start_timeout_s)
        try:
            store = _open_store(spec, rank, start, listener)
        except Exception as exc:  # the store failed: the socket is still ours to close
            if listener is not None:
                listener.close()
            raise RankFailure(f"rank {rank} could not join the tensor-parallel group at {spec.address} "
                              f"within {spec.start_timeout_s:g} s: {exc}") from exc
        if listener is not None:
            listener.detach()  # the store owns the socket now and closes it with the group
        try:
            dist.init_process_group(spec.backend, store=store, rank=rank, world_size=spec.world_size, timeout=start,
                                    pg_options=self._options(start))
        except Exception as exc:  # torch raises several types for a rendezvous that fails
            raise RankFailure(f"rank {rank} could not join the tensor-parallel group at {spec.address} "
                              f"within {spec.start_timeout_s:g} s: {exc}") from exc
        self._pg: Any = None  # the start-up (default) group until `serving`
        self._forward_pg: Any = None  # the forward's collectives: the gloo group (None) or an nccl group
        self.rank_device = CPU_RANK  # where this rank's forward runs (`serving`)
        self.is_open = True  # False after a failed collective: no more calls
        self._joined = True  # until close(): the process's default group is this one
        try:
            self._authenticate("start")
        except RankFailure:
            self.close()  # a peer died or hung mid-handshake: the caller never gets this object to close
            raise

    def _options(self, timeout: datetime.timedelta) -> Any:
        """gloo on the address this host reaches the master by (loopback for a loopback master)."""
        if self.spec.backend != "gloo":
            return None
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_address_towards(self.spec.master_addr))]
        options._timeout = timeout
        return options

    def serving(self, device: RankDevice = CPU_RANK) -> None:
        """Every rank is loaded: from now on each collective waits at most `spec.timeout_s`
        (a group of the same ranks with that timeout; every rank calls this once, in step, with
        the same kind of device). Where `device` has a forward group (nccl), it forms here too."""
        timeout = datetime.timedelta(seconds=self.spec.timeout_s)
        self._pg = self._new_group(self.spec.backend, timeout, self._options(timeout))
        # Its ranks' connections were set up anew through the store, which anyone who reaches it can write.
        self._authenticate("serving")
        if device.has_forward_group:  # so were the nccl group's (its unique id travels through the store)
            self._forward_pg = self._new_group(device.forward_backend, timeout, None)
            self.rank_device = device
            self._authenticate("forward", self._forward_pg, device.device)
        self._key = b""

    def _new_group(self, backend: str, timeout: datetime.timedelta, options: Any) -> Any:
        made: list[Any] = []
        self._call(lambda: made.append(dist.new_group(list(range(self.world_size)), timeout=timeout,
                                                      backend=backend, pg_options=options)))
        return made[0]

    def _authenticate(self, label: str, pg: Any = None, device: str = "cpu") -> None:
        """Every rank of group `pg` (None: the current gloo group) holds the key, or RankFailure (the
        groups closed on this rank) before anything else moves: `rank_auth.py` says why two
        all-gathers suffice."""
        pg = pg if pg is not None else self._pg
        nonces = self._all_gather_fixed(new_nonce(), NONCE_BYTES, pg, device)
        tags = self._all_gather_fixed(tag_of(self._key, label, self.world_size, self.rank, nonces), TAG_BYTES, pg,
                                      device)
        refused = refused_ranks(self._key, label, self.rank, nonces, tags)
        if not refused or is_active(Fault.SKIP_RANK_AUTH):
            return
        self.close()
        failure = RankFailure(
            f"rank {self.rank} refuses the tensor-parallel group at {self.spec.address}: rank(s) {refused} did not "
            f"prove they hold the engine's key ({label} handshake), so nothing of the model, a batch or KV was "
            f"sent; a process that is not one of this engine's ranks joined, or the nodes' --tp-key-file differ")
        logger.error("%s", failure)
        raise failure

    def _all_gather_fixed(self, data: bytes, size: int, pg: Any, device: str) -> list[bytes]:
        """Every rank's `size` bytes over `pg` (tensors on `device`), in rank order: no length from a
        peer sizes anything."""
        mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        parts = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(self.world_size)]
        self._call(lambda: dist.all_gather(parts, mine, group=pg))
        return [p.cpu().numpy().tobytes() for p in parts]

    def close(self) -> None:
        self.is_open = False
        if self._joined:
            self._joined = False
            try:
                dist.destroy_process_group()
            except Exception:  # a group whose peers are gone may fail to tear down; nothing to keep
                pass

    # ---- the forward's collectives (RankCollectives): the nccl group on CUDA, else the gloo group

    @property
    def forward_backend(self) -> str:
        return self.rank_device.forward_backend

    def all_reduce(self, t: torch.Tensor) -> None:
        pg = self._forward_pg if self._forward_pg is not None else self._pg
        self._call(lambda: dist.all_reduce(t, group=pg))

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        pg = self._forward_pg if self._forward_pg is not None else self._pg
        parts = [torch.empty_like(logits) for _ in range(self.world_size)] if self.rank == 0 else None
        self._call(lambda: dist.gather(logits, parts, dst=0, group=pg))
        return torch.cat(parts, dim=-1) if parts is not None else logits

    # ---- a PD handoff's head shards (`parallel/handoff.py`): byte tensors between rank 0 and one
    # other rank, on the CPU (the gloo group), whatever the ranks' device; each side sizes its
    # buffer from its own layout, never from a length a peer sent

    def send(self, t: torch.Tensor, dst: int) -> None:
        """`t` to rank `dst`, which receives it into a buffer of the same size (`recv`)."""
        self._call(lambda: dist.send(t, dst=dst, group=self._pg))

    def recv(self, out: torch.Tensor, src: int) -> None:
        """Rank `src`'s `send` into `out`."""
        self._call(lambda: dist.recv(out, src=src, group=self._pg))

    # ---- messages

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0 sends `data`; every rank returns it."""
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64)
        self._call(lambda: dist.broadcast(size, src=0, group=self._pg))
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data is not None and self.rank == 0 \
            else torch.empty(int(size), dtype=torch.uint8)
        if int(size):
            self._call(lambda: dist.broadcast(buf, src=0, group=self._pg))
        return buf.numpy().tobytes()

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's `data`, in rank order, on every rank."""
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        self._call(lambda: dist.all_gather(sizes, size, group=self._pg))
        longest = max(int(s) for s in sizes)
        if longest == 0:
            return [b""] * self.world_size
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        self._call(lambda: dist.all_gather(parts, mine, group=self._pg))
        return [p[:int(s)].numpy().tobytes() for p, s in zip(parts, sizes)]

    def _call(self, collective: Callable[[], object]) -> None:
        if not self.is_open:
            raise RankFailure(f"rank {self.rank}: the tensor-parallel group is closed after an earlier failure")
        try:
            collective()
        except Exception as exc:  # gloo raises RuntimeError (and DistBackendError) for a lost or late peer
            self.is_open = False
            raise RankFailure(f"rank {self.rank}: a tensor-parallel collective failed ({exc}); a rank died or "
                              f"did not answer within the group's timeout") from exc


def _open_store(spec: GroupSpec, rank: int, timeout: datetime.timedelta,
                listener: socket.socket | None) -> dist.Store:
    if spec.store_path is not None:
        store = dist.FileStore(spec.store_path, spec.world_size)
        store.set_timeout(timeout)
        # Every rank checks in before any group forms. torch.distributed numbers a process's
        # groups from a counter that a failed init_process_group still advances, so a rank 0
        # left waiting there for a rank that died would name the next engine's group (in the
        # same process) differently from its fresh workers', and they would never meet. Here a
        # missing rank leaves rank 0 waiting on the store, before the counter moves; the driver
        # removes the store's folder when it gives up, which ends the wait at once.
        store.set(f"kvseal/joined/{rank}", "1")
        store.wait([f"kvseal/joined/{r}" for r in range(spec.world_size)])
        return store
    return dist.TCPStore(spec.master_addr, spec.master_port, spec.world_size, rank == 0, timeout,
                         master_listen_fd=listener.fileno() if listener is not None else None)


def local_address_towards(addr: str) -> str:
    """This host's address on the route to `addr` (no packet is sent): 127.0.0.1 for a loopback
    master, the interface's own address otherwise; never a wildcard."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((addr, 9))
        return str(probe.getsockname()[0])


def listen_for_ranks(addr: str, port: int) -> socket.socket:
    """Rank 0's store socket on addr:port (0: a free port), bound before any rank starts."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((addr, port))
    except OSError as exc:
        listener.close()
        raise RankFailure(f"cannot listen for tensor-parallel ranks on {addr}:{port}: {exc}; pick another "
                          f"--master-port") from exc
    if ipaddress.ip_address(listener.getsockname()[0]).is_unspecified:  # a host name that stands for it
        listener.close()
        raise RankFailure(f"--master-addr {addr} is the any-address: rank 0 would take rank connections on every "
                          f"interface; name one address it listens on")
    listener.listen(128)
    return listener
