"""The NIXL transport (`--kv-transport nixl`): prompt KV as one-sided NIXL WRITEs (UCX backend).

Decode never lets a peer write its pool. It registers an *arena* with NIXL instead: one slot
per pool page, `[tag | layers x (K, V) x kv_heads x page_size x head_dim]`, so one page of
every layer is one contiguous run and a run of consecutive pages is one descriptor. Prefill
stages the request's pages in that layout (every slot tagged with the transfer id), writes
them into the arena slots of decode's reserved pages with one NIXL WRITE, and names the
transfer and what it wrote (`NixlLandedMsg`) as the WRITE's notification, which NIXL delivers
only after every write of the request landed. Only then does decode look at the arena: it
checks every slot's tag, copies the slots into the reservation's pages (zeros past what was
written) and records what landed; the commit still arrives over the control channel and is
verified against those records exactly as for the TCP transport.

NIXL cannot cancel a write in flight, so `cancel` is True only once no write can land: the
notification arrived, or prefill said it is finished (its commit or abort, sent only after its
WRITE reached a terminal state), or, with neither, `drain_s` after the first cancel (a dead
sender writes nothing; a stale write that lands later in a reused slot fails the tag check).

Everything needed to reach a decode engine travels in its `kv_address`
(`nixl:` + base64 of `NixlPeerMsg`: agent metadata, arena address and slot size), so a
restarted decode engine (a new agent) is reached through the address its reservations name.
"""

from __future__ import annotations

import base64
import ipaddress
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from kvseal.disagg.args import DEFAULT_DRAIN_S
from kvseal.disagg.msgs import KVKind
from kvseal.disagg.transport import KINDS, Landing, PushPlan, TransportError
from kvseal.errors import ConfigError
from kvseal.kvcache.pool import KVPool

logger = logging.getLogger("kvseal.disagg")

NAME = "nixl"
ADDRESS_PREFIX = "nixl:"
TAG_BYTES = 64  # per slot: the transfer id that wrote it (also keeps the body 64-byte aligned)
PUSH_TIMEOUT_S = 30.0  # prefill gives up waiting for its WRITE after this long (TransportError)
NOTIF_WAIT_S = 5.0  # decode waits this long for the notification of a transfer prefill says is done
POLL_SLEEP_S = 0.0002
PROGRESS_DELAY_US = 500  # NIXL's progress thread sleeps this long between polls


class NixlPeerMsg(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """What a sender needs to write into a decode engine's arena (inside its `kv_address`)."""

    agent_name: str
    metadata: bytes  # `nixl_agent.get_agent_metadata()`, taken after the arena was registered
    arena_address: int
    slot_bytes: int
    num_slots: int


class NixlLandedMsg(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """The WRITE's notification: positions [start, ends[layer]) of K and V of every layer were
    written into the reservation's slots, in page order (`start`: where decode's cache hit
    ends, known to both from the reservation). Delivered after every write landed."""

    transfer_id: str
    ends: list[int]


_peer_decoder = msgspec.msgpack.Decoder(NixlPeerMsg)
_landed_decoder = msgspec.msgpack.Decoder(NixlLandedMsg)


@dataclass(frozen=True)
class SlotLayout:
    """One arena slot: a page of every layer, K then V, head-major inside, after a tag."""

    num_layers: int
    num_kv_heads: int
    page_size: int
    head_dim: int
    dtype: torch.dtype

    @classmethod
    def of(cls, pool: KVPool) -> SlotLayout:
        num_kv_heads, page_size, head_dim = pool.page_shape()
        return cls(len(pool.k), num_kv_heads, page_size, head_dim, pool.k[0].dtype)

    @property
    def slot_bytes(self) -> int:
        item = torch.empty((), dtype=self.dtype).element_size()
        return TAG_BYTES + self.num_layers * 2 * self.num_kv_heads * self.page_size * self.head_dim * item

    def body(self, slots: torch.Tensor) -> torch.Tensor:
        """uint8 [n, slot_bytes] -> a view [n, layers, 2, kv_heads, page_size, head_dim]."""
        return slots[:, TAG_BYTES:].view(self.dtype).unflatten(
            -1, (self.num_layers, 2, self.num_kv_heads, self.page_size, self.head_dim))


def tag_of(transfer_id: str) -> torch.Tensor:
    raw = transfer_id.encode()[:TAG_BYTES].ljust(TAG_BYTES, b"\0")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def make_agent(name: str, listen_host: str) -> Any:
    """A NIXL agent with the UCX backend. On a loopback `--listen` host UCX is confined to the
    loopback interface (`UCX_NET_DEVICES=lo`, unless the operator set it): engines bind only
    the address they are given."""
    try:
        if _is_loopback(listen_host):
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise ConfigError(f"--kv-transport nixl needs the nixl package (pip install nixl==1.5.1): {exc}") from exc
    if "NIXL_LOG_LEVEL" not in os.environ:  # nixl logs every agent's start at INFO, on stdout
        logging.getLogger("nixl").setLevel(logging.WARNING)
    bindings = sys.modules[nixl_agent.__module__].nixlBind
    make_native = bindings.nixlAgent

    def with_progress_delay(agent_name: str, config: Any) -> Any:
        # nixl's Python API starts its progress thread with no delay between polls: half a core
        # per idle agent. A short sleep between polls costs at most that much notification latency.
        config.pthrDelay = PROGRESS_DELAY_US
        return make_native(agent_name, config)

    bindings.nixlAgent = with_progress_delay
    try:
        return nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    except Exception as exc:  # nixl raises its own exception types from C++
        raise ConfigError(f"cannot start a NIXL agent with the UCX backend: {exc}") from exc
    finally:
        bindings.nixlAgent = make_native


def _is_loopback(host: str) -> bool:
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def encode_address(peer: NixlPeerMsg) -> str:
    return ADDRESS_PREFIX + base64.urlsafe_b64encode(msgspec.msgpack.encode(peer)).decode()


def decode_address(address: str) -> NixlPeerMsg:
    if not address.startswith(ADDRESS_PREFIX):
        raise TransportError(f"not a NIXL KV address: {address[:40]!r} (is the decode engine on --kv-transport "
                             f"nixl?)")
    try:
        return _peer_decoder.decode(base64.urlsafe_b64decode(address[len(ADDRESS_PREFIX):]))
    except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise TransportError(f"malformed NIXL KV address: {exc}") from exc


# ---- decode --------------------------------------------------------------------------------


class NixlReceiver:
    name = NAME

    def __init__(self, pool: KVPool, agent_name: str, listen_host: str, drain_s: float = DEFAULT_DRAIN_S) -> None:
        self._pool = pool
        self._layout = SlotLayout.of(pool)
        self._drain_s = drain_s
        self._agent = make_agent(agent_name, listen_host)
        self._arena = torch.zeros((pool.num_pages, self._layout.slot_bytes), dtype=torch.uint8)
        self._registration = self._agent.register_memory(self._arena)
        self._address = encode_address(NixlPeerMsg(agent_name, self._agent.get_agent_metadata(),
                                                   self._arena.data_ptr(), self._layout.slot_bytes, pool.num_pages))
        self._pages: dict[str, list[int]] = {}  # authorized transfers -> their pages, position order
        self._starts: dict[str, int] = {}  # authorized transfers -> the first position they may write
        self._landed: dict[str, Landing] = {}
        self._notified: set[str] = set()  # the notification arrived: nothing of the transfer can land
        self._finished: set[str] = set()  # the sender said it wrote all it will (commit or abort)
        self._cancelling: dict[str, float] = {}  # cancelled, unconfirmed -> when first cancelled
        self.num_refused = 0

    @property
    def address(self) -> str:
        return self._address

    def authorize(self, transfer_id: str, pages: list[int], start: int = 0) -> None:
        self._arena[pages, :TAG_BYTES] = 0  # a tag left by an earlier transfer never counts
        self._pages[transfer_id] = list(pages)
        self._starts[transfer_id] = start  # [0, start): decode's cache hit, never imported into
        self._landed[transfer_id] = Landing(start + len(pages) * self._pool.page_size)

    def sender_done(self, transfer_id: str) -> None:
        if transfer_id in self._pages or transfer_id in self._cancelling:
            self._finished.add(transfer_id)

    def deliver(self, header: object, payload: list[memoryview]) -> str | None:
        return "wrong_transport"  # KV reaches a NIXL decode engine only through NIXL

    def landed(self, transfer_id: str) -> Landing | None:
        self._poll()
        deadline = time.monotonic() + NOTIF_WAIT_S
        while (transfer_id in self._finished and transfer_id not in self._notified
               and time.monotonic() < deadline):
            time.sleep(POLL_SLEEP_S)  # the sender saw its WRITE done: the notification is on its way
            self._poll()
        return self._landed.get(transfer_id)

    def cancel(self, transfer_id: str) -> bool:
        self._poll()
        self._pages.pop(transfer_id, None)  # from now on nothing of it is imported
        self._starts.pop(transfer_id, None)
        self._landed.pop(transfer_id, None)
        first_s = self._cancelling.setdefault(transfer_id, time.monotonic())
        confirmed = transfer_id in self._notified or transfer_id in self._finished
        if not confirmed and time.monotonic() - first_s < self._drain_s:
            return False
        if not confirmed:
            logger.warning("transfer %s: no NIXL completion and no word from prefill within %g s; releasing its "
                           "pages (a late write can only reach the arena, where its tag no longer matches)",
                           transfer_id, self._drain_s)
        self._cancelling.pop(transfer_id, None)
        self._notified.discard(transfer_id)
        self._finished.discard(transfer_id)
        return True

    def _poll(self) -> None:
        for sender, messages in self._agent.get_new_notifs().items():
            for raw in messages:
                try:
                    note = _landed_decoder.decode(raw)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    logger.error("dropping an undecodable NIXL notification from %s", sender)
                    continue
                if note.transfer_id in self._pages and note.transfer_id not in self._notified:
                    self._import(note)
                if note.transfer_id in self._pages or note.transfer_id in self._cancelling:
                    self._notified.add(note.transfer_id)

    def _import(self, note: NixlLandedMsg) -> None:
        """Copy what the transfer wrote from its arena slots into its pages, and record it."""
        pages, landing = self._pages[note.transfer_id], self._landed[note.transfer_id]
        page_size, layout = self._pool.page_size, self._layout
        if len(note.ends) != layout.num_layers or not all(0 <= e <= landing.num_positions for e in note.ends):
            self._refuse(note, "write_outside_reservation")
            return
        start = self._starts[note.transfer_id]  # `pages` hold positions [start, ...)
        num_pages = max(0, -(-max(note.ends, default=0) // page_size) - start // page_size)
        tagged = self._tagged(pages[:num_pages], note.transfer_id)
        if not tagged():
            self._refuse(note, "foreign_or_stale_write")
            return
        body = layout.body(self._arena)
        copied: list[tuple[int, KVKind, int, int]] = []
        for layer, end in enumerate(note.ends):
            if end <= start:
                continue
            used = -(-(end - start) // page_size)
            slots = torch.tensor(pages[:used], dtype=torch.int64)
            first = pages[0]
            in_place = pages[:used] == list(range(first, first + used))  # consecutive slots: read in place
            for kind_index, kind in enumerate(KINDS):
                part = body[first:first + used, layer, kind_index] if in_place else body[slots, layer, kind_index]
                data = part.transpose(0, 1)  # [kv_heads, used, page_size, head_dim]
                data[:, -1, end - start - (used - 1) * page_size:] = 0  # only [start, end) may land
                self._pool.import_pages(layer, kind, slots, data)
                copied.append((layer, kind, end, data.numel() * data.element_size()))
        if not tagged():  # a write landed while we copied: the pages hold a mix; record nothing
            self._refuse(note, "foreign_or_stale_write")
            return
        for layer, kind, end, num_bytes in copied:
            landing.add(layer, kind, start, end, num_bytes)

    def _tagged(self, slots: list[int], transfer_id: str) -> Callable[[], bool]:
        """A check that every one of `slots` carries the transfer's tag (asked before and after copying)."""
        tag, index = tag_of(transfer_id), torch.tensor(slots, dtype=torch.int64)
        return lambda: bool((self._arena[index, :TAG_BYTES] == tag).all())

    def _refuse(self, note: NixlLandedMsg, why: str) -> None:
        self.num_refused += 1
        logger.warning("refused the NIXL write of transfer %s: %s", note.transfer_id, why)

    def close(self) -> None:
        self._agent.deregister_memory(self._registration)


# ---- prefill -------------------------------------------------------------------------------


@dataclass
class _InFlight:
    """A WRITE that did not finish in time: its handle and source stay alive until it does."""

    handle: Any
    staging: torch.Tensor
    registration: Any


class NixlSender:
    name = NAME

    def __init__(self, agent_name: str, listen_host: str, timeout_s: float = PUSH_TIMEOUT_S) -> None:
        self._agent = make_agent(agent_name, listen_host)
        self._timeout_s = timeout_s
        self._remotes: dict[str, str] = {}  # decode's agent name -> NIXL's handle name for it
        self._in_flight: list[_InFlight] = []
        self._staging: torch.Tensor | None = None  # registered once, reused by every push
        self._staging_registration: Any = None

    def push(self, plan: PushPlan, pool: KVPool) -> int:
        """Stage, WRITE and wait for NIXL's completion; the notification names what was written.
        Returns only once the WRITE is terminal (or raises `TransportError`)."""
        self._reap()
        peer = decode_address(plan.kv_address)
        layout = SlotLayout.of(pool)
        if peer.slot_bytes != layout.slot_bytes:
            raise TransportError(f"decode's KV slots are {peer.slot_bytes} bytes, ours {layout.slot_bytes}: "
                                 f"the engines' KV layouts differ")
        first = plan.start // pool.page_size  # decode already holds [0, start): not sent
        num_pages = max(0, -(-max(plan.written, default=0) // pool.page_size) - first)
        dest = plan.dest_pages[first:first + num_pages]
        if len(dest) < num_pages or not all(0 <= p < peer.num_slots for p in dest):
            raise TransportError(f"transfer {plan.transfer_id}: decode's reservation does not hold {num_pages} pages")
        note = msgspec.msgpack.encode(NixlLandedMsg(plan.transfer_id, list(plan.written)))
        remote = self._remote(peer)
        try:
            if num_pages == 0:
                self._agent.send_notif(remote, note)  # nothing to write: still say so
                return 0
            staging = self._stage(plan, pool, layout, num_pages)
            self._write(staging, dest, peer, remote, note)
        except TransportError:
            self._forget(peer)
            raise
        except Exception as exc:  # nixl's own exception types (peer gone, connection refused)
            self._forget(peer)
            raise TransportError(f"NIXL write to {peer.agent_name} failed: {exc}") from exc
        return staging.numel()

    def _remote(self, peer: NixlPeerMsg) -> str:
        if peer.agent_name not in self._remotes:
            try:
                name = self._agent.add_remote_agent(peer.metadata)
            except Exception as exc:
                raise TransportError(f"cannot load the NIXL metadata of {peer.agent_name}: {exc}") from exc
            self._remotes[peer.agent_name] = name.decode() if isinstance(name, bytes) else name
        return self._remotes[peer.agent_name]

    def _forget(self, peer: NixlPeerMsg) -> None:
        """After a failure: reload the peer's metadata next time (it may have restarted)."""
        name = self._remotes.pop(peer.agent_name, None)
        if name is not None:
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:
                logger.warning("could not remove NIXL peer %s: %s", name, exc)

    def _buffer(self, num_bytes: int) -> torch.Tensor:
        """The registered staging buffer, grown (and registered again) when a push needs more."""
        if self._staging is None or self._staging.numel() < num_bytes:
            if self._staging is not None:
                self._agent.deregister_memory(self._staging_registration)
            self._staging = torch.empty(num_bytes, dtype=torch.uint8)
            self._staging_registration = self._agent.register_memory(self._staging)
        return self._staging[:num_bytes]

    def _stage(self, plan: PushPlan, pool: KVPool, layout: SlotLayout, num_pages: int) -> torch.Tensor:
        """The request's `num_pages` pages from `plan.start` on in slot layout, tagged; zeros where unwritten."""
        staging = self._buffer(num_pages * layout.slot_bytes).view(num_pages, layout.slot_bytes)
        staging[:, :TAG_BYTES] = tag_of(plan.transfer_id)
        body = layout.body(staging)
        first = plan.start // pool.page_size
        for layer, end in enumerate(plan.written):
            used = max(0, -(-end // pool.page_size) - first)
            if used:
                index = torch.tensor(plan.src_pages[first:first + used], dtype=torch.int64)
                for kind_index, source in enumerate((pool.k[layer], pool.v[layer])):  # gathered straight in
                    torch.index_select(source.transpose(0, 1), 0, index, out=body[:used, layer, kind_index])
                body[used - 1, layer, :, :, end - (first + used - 1) * pool.page_size:] = 0  # nothing past `end`
            body[used:, layer] = 0  # no stale bytes of an earlier push leave this buffer
        return staging

    def _write(self, staging: torch.Tensor, dest: list[int], peer: NixlPeerMsg, remote: str, note: bytes) -> None:
        local_rows, remote_rows = _runs(staging.data_ptr(), peer.arena_address, peer.slot_bytes, dest)
        handle = self._agent.initialize_xfer("WRITE", self._agent.get_xfer_descs(local_rows, "DRAM"),
                                             self._agent.get_xfer_descs(remote_rows, "DRAM"), remote, note)
        try:
            state = self._agent.transfer(handle)
            deadline = time.monotonic() + self._timeout_s
            while state == "PROC" and time.monotonic() < deadline:
                time.sleep(POLL_SLEEP_S)
                state = self._agent.check_xfer_state(handle)
        except Exception:
            state = "PROC"  # posted, state unknown: treat as still in flight
        if state == "PROC":  # never reuse or free what NIXL may still read: the next push gets a new buffer
            assert self._staging is not None
            self._in_flight.append(_InFlight(handle, self._staging, self._staging_registration))
            self._staging, self._staging_registration = None, None
            raise TransportError(f"the NIXL write to {peer.agent_name} did not reach a terminal state within "
                                 f"{self._timeout_s:g} s")
        self._agent.release_xfer_handle(handle)
        if state != "DONE":
            raise TransportError(f"the NIXL write to {peer.agent_name} failed (state {state})")

    def _reap(self) -> None:
        """Release late WRITEs that reached a terminal state."""
        still = []
        for job in self._in_flight:
            try:
                state = self._agent.check_xfer_state(job.handle)
            except Exception as exc:  # NIXL no longer knows the request: it is over
                logger.warning("a late NIXL write ended with %s", exc)
                state = "ERR"
            if state == "PROC":
                still.append(job)
            else:
                self._agent.release_xfer_handle(job.handle)
                self._agent.deregister_memory(job.registration)
        self._in_flight = still

    def close(self) -> None:
        self._reap()
        if self._staging is not None:
            self._agent.deregister_memory(self._staging_registration)
            self._staging = None


def _runs(local_base: int, remote_base: int, slot_bytes: int, dest: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Descriptor rows (address, length, device 0) for staging slot i -> arena slot dest[i],
    one row per run of consecutive destination pages."""
    starts = [0] + [i for i in range(1, len(dest)) if dest[i] != dest[i - 1] + 1]
    lengths = np.diff(np.array([*starts, len(dest)], dtype=np.uint64))
    local = np.zeros((len(starts), 3), dtype=np.uint64)
    remote = np.zeros((len(starts), 3), dtype=np.uint64)
    local[:, 0] = local_base + np.array(starts, dtype=np.uint64) * slot_bytes
    remote[:, 0] = remote_base + np.array([dest[s] for s in starts], dtype=np.uint64) * slot_bytes
    local[:, 1] = remote[:, 1] = lengths * slot_bytes
    return local, remote
