"""The NIXL transport (`--kv-transport nixl`): prompt KV as one-sided NIXL WRITEs (UCX backend).

Decode never lets a peer write its pool. It registers an *arena* with NIXL instead, laid out
like the pool: a 64-byte tag per arena page, then per layer, K/V and kv head the arena pages
`[num_pages, page_size, head_dim]`, so a run of consecutive arena pages of one head is one
contiguous block. Arena pages are decode's to hand out, apart from its pool pages: each
authorized transfer gets its own arena pages, the lowest run of free ones that fits when
there is one (arena pages are held only while a transfer can land, so the arena is rarely
fragmented even when the pool is), and the transfer's `kv_address` names them. A push is then
one descriptor per layer, K/V and head whatever decode's pool pages are. Arena pages are zeroed,
tags and KV, when a transfer gets them and when it gives them back (`zero_pages`): whatever a
transfer does not write reads as zeros, never an earlier transfer's KV (a late write into a
free page included), and no arena page a transfer no longer holds keeps its KV.

Prefill WRITEs the full pages of a request straight from its registered pool when its pages
form few runs (its own memory: it never sends its agent metadata to anyone, so no peer holds a
key to it); when they are scattered it first gathers them into a registered staging buffer
(NIXL's per-descriptor cost on one-page descriptors is far above the gather's). Each layer's
last, partial page is always staged with zeros past what was written (no stale bytes leave
the pool), and every arena page written carries the transfer's tag (its id and an HMAC of it
under the transfer's secret key, `tag_of`). One push is a few
WRITEs, one per group of layers, each naming what it wrote (`NixlLandedMsg`) in its
notification, which NIXL delivers only after every write of that WRITE landed: decode copies
one group from the arena into its pages while the next group is still on the wire. Each group
is about half the one before (30 layers: 16, 8, 4, 2), so the copy left once the last WRITE
landed is small. Decode
looks at the arena only on a notification: it checks the tag of every arena page the
transfer owns, copies them into the reservation's pages (zeros past what was written) and
records what landed; the commit still arrives over the control channel and is verified
against those records exactly as for the TCP transport. What decode records follows the
notification: the tags prove only that the sender wrote each page's tag, not its KV, so a
WRITE that leaves out part of what its notification names (a sender's bug) is not refused;
what it left out reads as the zeros its arena pages were handed out with (that request's
answer is wrong, and holds no other transfer's KV).

Prefill's `push` returns only once every WRITE reached a terminal state (NIXL reads the
request's pages until then, so they must not be freed earlier): past its timeout it drops the
connection to the peer and keeps waiting (blocking rather than freeing pages under a read).

NIXL cannot cancel a write in flight, so `cancel` is True only once no write can land: every
notification of the push arrived, or prefill said it is finished (its commit or abort, sent
only after its WRITEs reached a terminal state), or the frontend said it never gave the
transfer to a prefill engine (`sender_done` either way), or, with none of these, `drain_s`
after the first cancel (a dead sender writes nothing; a stale write that lands later in a reused arena page
fails the tag check, one in a free page is zeroed when the page is handed out). The
transfer's arena pages are zeroed and handed out again only then.

Everything needed to reach a decode engine travels in the transfer's `kv_address`
(`nixl:` + base64 of `NixlPeerMsg`: agent metadata, arena address and layout, the transfer's
arena pages), so a restarted decode engine (a new agent) is reached through the address its
reservations name.

Authentication (I9): that metadata exchange runs over the authenticated control links only
(`ReservedMsg` to the frontend, `PrefillMsg` to prefill, both CURVE), and nixl's own metadata
listener (`enable_listen_thread`) stays off. What NIXL does listen on is UCX's: each agent's
UCX worker opens a TCP listener on an ephemeral port (on loopback only for a loopback
`--listen`, see `make_agent`), without authentication of its own; within one host UCX moves
the bytes with CMA. A peer that learned decode's metadata could therefore WRITE into decode's
arena, never its pool: decode copies an arena page into a reservation only if it carries the
transfer's keyed tag, which only a holder of the transfer key can make. It could READ the
arena as well (NIXL serves one-sided READs of registered memory): the KV of transfers in
flight, not of one that ended, whose arena pages were zeroed when given back, save a write of
a sender so slow that decode released its transfer on the drain timeout (`cancel`) and that
lands afterwards in the free pages, until they are zeroed again for the next transfer.
"""

from __future__ import annotations

import base64
import contextlib
import hmac
import importlib.metadata
import ipaddress
import logging
import os
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import torch

from kvseal._testing.faults import Fault, is_active
from kvseal.disagg.config import DEFAULT_DRAIN_S
from kvseal.disagg.msgs import KVKind
from kvseal.disagg.transport import (
    KINDS,
    Landing,
    PushPlan,
    RunsMemo,
    TransportError,
    copy_pages,
    joint_runs,
    page_runs,
    zero_pages,
)
from kvseal.errors import ConfigError
from kvseal.kvcache.allocator import lowest_free_run
from kvseal.kvcache.pool import KVPool

logger = logging.getLogger("kvseal.disagg")

NAME = "nixl"
ADDRESS_PREFIX = "nixl:"
TAG_BYTES = 64  # per arena page: the transfer that wrote it, keyed (also keeps the body 64-byte aligned)
TAG_DOMAIN = b"kvseal/nixl-arena-tag/v1\0"
PUSH_TIMEOUT_S = 30.0  # past this, prefill drops the connection to a peer whose WRITE is not terminal
NUM_PARTS = 4  # WRITEs per push (groups of layers): decode copies one while the next lands
# A push reads prefill's pool in place when its full pages, joint with decode's arena pages,
# form at most this many runs; more, and it gathers them into staging first. Measured on this
# host: 23,040 one-page descriptors ran at 0.09x of one WRITE of the same bytes.
MAX_DIRECT_RUNS = 8
NOTIF_WAIT_S = 5.0  # decode waits this long for the notification of a transfer prefill says is done
POLL_SLEEP_S = 0.0002
PROGRESS_DELAY_US = 500  # NIXL's progress thread sleeps this long between polls (`progress_delay`)
NIXL_PINNED = "1.5.1"  # the version of the `nixl` extra, whose internals `progress_delay` relies on


class NixlPeerMsg(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """What a sender needs to write one transfer into a decode engine's arena (its `kv_address`)."""

    agent_name: str
    metadata: bytes  # `nixl_agent.get_agent_metadata()`, taken after the arena was registered
    arena_address: int
    num_pages: int  # arena pages
    layout: str  # `ArenaLayout.key`: both engines' KV layouts must be the same
    # The transfer's arena pages, for its page indexes first_page, first_page + 1, ... in
    # position order, as runs (first arena page, count). Empty: not a transfer's address.
    first_page: int = 0
    arena_runs: list[tuple[int, int]] = []

    def arena_pages(self) -> list[int]:
        return [page for first, count in self.arena_runs for page in range(first, first + count)]


class NixlLandedMsg(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """One WRITE's notification: positions [start, ends[i]) of K and V of layer first_layer + i
    were written into the transfer's arena pages (position order), with the transfer's tag on
    each of those pages. Delivered after every write of that WRITE landed; a push is `num_parts`."""

    transfer_id: str
    start: int
    first_layer: int
    ends: list[int]
    part: int
    num_parts: int


_peer_decoder = msgspec.msgpack.Decoder(NixlPeerMsg)
_landed_decoder = msgspec.msgpack.Decoder(NixlLandedMsg)


@dataclass(frozen=True)
class ArenaLayout:
    """`num_pages` tags, then the pages: [layers, 2 (K, V), kv_heads, num_pages, page_size, head_dim]."""

    num_layers: int
    num_kv_heads: int
    page_size: int
    head_dim: int
    dtype: torch.dtype
    num_pages: int

    @classmethod
    def of(cls, pool: KVPool, num_pages: int | None = None) -> ArenaLayout:
        num_kv_heads, page_size, head_dim = pool.page_shape()
        return cls(len(pool.k), num_kv_heads, page_size, head_dim, pool.k[0].dtype,
                   pool.num_pages if num_pages is None else num_pages)

    @property
    def key(self) -> str:
        return (f"layers={self.num_layers},kv_heads={self.num_kv_heads},page_size={self.page_size},"
                f"head_dim={self.head_dim},dtype={self.dtype}")

    @property
    def page_bytes(self) -> int:
        """One page of one layer, K or V, one head."""
        return self.page_size * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @property
    def body_offset(self) -> int:
        return self.num_pages * TAG_BYTES

    @property
    def num_bytes(self) -> int:
        return self.body_offset + self.num_layers * 2 * self.num_kv_heads * self.num_pages * self.page_bytes

    def block_offset(self, layer: int, kind_index: int, head: int, page: int) -> int:
        """Byte offset of (layer, K/V, head, page) in the arena."""
        return self.body_offset + (((layer * 2 + kind_index) * self.num_kv_heads + head) * self.num_pages
                                   + page) * self.page_bytes

    def tags(self, arena: torch.Tensor) -> torch.Tensor:
        """uint8 [num_bytes] -> [num_pages, TAG_BYTES]"""
        return arena[:self.body_offset].view(self.num_pages, TAG_BYTES)

    def body(self, arena: torch.Tensor) -> torch.Tensor:
        """uint8 [num_bytes] -> [layers, 2, kv_heads, num_pages, page_size, head_dim]"""
        return arena[self.body_offset:].view(self.dtype).view(
            self.num_layers, 2, self.num_kv_heads, self.num_pages, self.page_size, self.head_dim)


class ArenaPages:
    """Which arena pages are free. A transfer takes the lowest run of free pages that fits (one
    descriptor per layer, K/V and head), or, when no run fits, the lowest free pages."""

    def __init__(self, num_pages: int) -> None:
        self._free = np.ones(num_pages, dtype=bool)

    @property
    def num_free(self) -> int:
        return int(self._free.sum())

    def take(self, num_pages: int) -> list[int]:
        first = lowest_free_run(self._free, num_pages)
        if first is not None:
            pages = list(range(first, first + num_pages))
        else:
            pages = np.flatnonzero(self._free)[:num_pages].tolist()
        if len(pages) < num_pages:  # arena pages = pool pages, held no longer than the pool pages they carry
            raise RuntimeError(f"the NIXL arena has {len(pages)} free pages, a transfer needs {num_pages}")
        self._free[pages] = False
        return pages

    def give_back(self, pages: list[int]) -> None:
        assert not self._free[pages].any(), "an arena page given back twice"
        self._free[pages] = True


def part_sizes(num_layers: int, num_parts: int) -> list[int]:
    """Layers per WRITE, halving from one to the next, each at least 1, summing to `num_layers`."""
    sizes: list[int] = []
    for part in range(min(num_parts, num_layers)):
        left = min(num_parts, num_layers) - part  # parts still to size, this one included
        weight = 2 ** (left - 1) / (2 ** left - 1)  # this part's share of what is left
        sizes.append(max(1, min(num_layers - sum(sizes) - (left - 1), round((num_layers - sum(sizes)) * weight))))
    return sizes


def tag_of(transfer_id: str, key: bytes) -> torch.Tensor:
    """An arena page's tag for a transfer: its id, then an HMAC of the id under the transfer's
    secret key (I9), so only who holds the key (it travels on authenticated links only) can
    make decode take an arena page in."""
    name = transfer_id.encode()[:TAG_BYTES // 2].ljust(TAG_BYTES // 2, b"\0")
    proof = hmac.digest(key, TAG_DOMAIN + transfer_id.encode(), "sha256")[:TAG_BYTES // 2]
    return torch.frombuffer(bytearray(name + proof), dtype=torch.uint8)


def make_agent(name: str, listen_host: str) -> Any:
    """A NIXL agent with the UCX backend. On a loopback `--listen` host UCX is confined to the
    loopback interface (`UCX_NET_DEVICES=lo`, unless the operator set it): engines bind only
    the address they are given."""
    try:
        if _is_loopback(listen_host):
            os.environ.setdefault("UCX_NET_DEVICES", "lo")
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        raise ConfigError(f"--kv-transport nixl needs the nixl package, an optional extra: pip install "
                          f"'kvseal[nixl]' ({exc})") from exc
    if "NIXL_LOG_LEVEL" not in os.environ:  # nixl logs every agent's start at INFO, on stdout
        logging.getLogger("nixl").setLevel(logging.WARNING)
    config = nixl_agent_config(backends=["UCX"])
    try:
        with progress_delay(nixl_agent, PROGRESS_DELAY_US):
            return nixl_agent(name, config)
    except Exception as exc:  # nixl raises its own exception types from C++
        raise ConfigError(f"cannot start a NIXL agent with the UCX backend: {exc}") from exc


@contextlib.contextmanager
def progress_delay(agent_class: Any, delay_us: int) -> Iterator[None]:
    """While an agent is made, its progress thread sleeps `delay_us` between polls.

    The one workaround of NIXL's internals, pinned and tested: nixl's public API (1.5.1, the
    version the `nixl` extra pins) starts the progress thread with no delay between polls, half
    a core per idle agent, and has no setting for it; its progress thread cannot be dropped
    either (a WRITE then completes only while the receiver polls, and prefill's `push` blocks
    on it). So the native config's `pthrDelay` is set as `nixl_agent.__init__` builds it, only
    on the pinned version, whose `__init__` `tests/disagg/test_nixl_pin.py` checks does what
    this assumes; any other version gets nixl's default (and a warning)."""
    version = importlib.metadata.version("nixl")
    if version != NIXL_PINNED:
        logger.warning("nixl %s is not the pinned %s: its progress thread runs without a delay between polls "
                       "(about half a core per idle engine)", version, NIXL_PINNED)
        yield
        return
    bindings = sys.modules[agent_class.__module__].nixlBind
    make_native = bindings.nixlAgent

    def with_delay(agent_name: str, native_config: Any) -> Any:
        native_config.pthrDelay = delay_us
        return make_native(agent_name, native_config)

    bindings.nixlAgent = with_delay
    try:
        yield
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
        self._layout = ArenaLayout.of(pool)
        self._drain_s = drain_s
        self._agent = make_agent(agent_name, listen_host)
        self._arena = torch.zeros(self._layout.num_bytes, dtype=torch.uint8)
        self._tags, self._body = self._layout.tags(self._arena), self._layout.body(self._arena)
        self._rows = self._body.flatten(0, 2)  # [layers x K/V x kv_heads, num_pages, page_size, head_dim], a view
        self._free = ArenaPages(pool.num_pages)
        self._registration = self._agent.register_memory(self._arena)
        self._peer = NixlPeerMsg(agent_name, self._agent.get_agent_metadata(), self._arena.data_ptr(),
                                 pool.num_pages, self._layout.key)
        self._pages: dict[str, list[int]] = {}  # authorized transfers -> their pages, position order
        self._starts: dict[str, int] = {}  # authorized transfers -> the first position they may write
        self._tags_of: dict[str, torch.Tensor] = {}  # authorized transfers -> their arena pages' tag
        self._arena_pages: dict[str, list[int]] = {}  # until confirmed over -> arena pages, parallel to pages
        self._landed: dict[str, Landing] = {}
        self._parts: dict[str, set[int]] = {}  # the parts whose notification arrived
        self._notified: set[str] = set()  # every part's notification arrived: nothing of the transfer can land
        self._finished: set[str] = set()  # nothing more will be written: prefill's commit or abort, or no sender
        self._cancelling: dict[str, float] = {}  # cancelled, unconfirmed -> when first cancelled
        self._refused: set[str] = set()  # a WRITE of the transfer was refused: nothing more of it is imported
        self.num_refused = 0  # transfers refused

    @property
    def address(self) -> str:
        """The engine's agent and arena, naming no arena pages (no transfer can be written to it)."""
        return encode_address(self._peer)

    def address_for(self, transfer_id: str) -> str:
        arena = self._arena_pages.get(transfer_id)
        if arena is None or transfer_id not in self._pages:
            return self.address
        runs = [(first, count) for _, first, count in page_runs(arena)]
        first_page = self._starts[transfer_id] // self._pool.page_size
        return encode_address(msgspec.structs.replace(self._peer, first_page=first_page, arena_runs=runs))

    def authorize(self, transfer_id: str, pages: list[int], start: int = 0, *, key: bytes) -> None:
        old = self._arena_pages.pop(transfer_id, None)
        if old is not None:  # authorized again (a test's changed start): a fresh mapping
            self._give_back(old)
        arena = self._take(len(pages))
        self._arena_pages[transfer_id] = arena
        self._pages[transfer_id] = list(pages)
        self._starts[transfer_id] = start  # [0, start): decode's cache hit, never imported into
        self._tags_of[transfer_id] = tag_of(transfer_id, key)
        self._landed[transfer_id] = Landing(start + len(pages) * self._pool.page_size)

    def progress(self) -> None:
        self._poll()  # parts whose notification arrived are copied in while later parts land

    def sender_done(self, transfer_id: str) -> None:
        if transfer_id in self._pages or transfer_id in self._cancelling:
            self._finished.add(transfer_id)

    def settled(self, transfer_id: str) -> bool:
        return True  # the commit follows prefill's last WRITE, and decode checks the parts it took in

    def take_refusals(self) -> Counter[str]:
        return Counter()  # not counted here: a part it refuses is never copied in, and coverage shows it

    def fds(self) -> list[socket.socket]:
        return []  # NIXL's progress is polled

    def deliver(self, header: object, payload: list[memoryview]) -> str | None:
        return "wrong_transport"  # KV reaches a NIXL decode engine only through NIXL

    def landed(self, transfer_id: str) -> Landing | None:
        self._poll()
        deadline = time.monotonic() + NOTIF_WAIT_S
        while (transfer_id in self._finished and transfer_id not in self._notified
               and time.monotonic() < deadline):
            time.sleep(POLL_SLEEP_S)  # the sender saw its WRITEs done: the notifications are on their way
            self._poll()
        return self._landed.get(transfer_id)

    def cancel(self, transfer_id: str) -> bool:
        self._poll()
        self._pages.pop(transfer_id, None)  # from now on nothing of it is imported
        self._starts.pop(transfer_id, None)
        self._tags_of.pop(transfer_id, None)
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
        self._parts.pop(transfer_id, None)
        self._refused.discard(transfer_id)
        self._notified.discard(transfer_id)
        self._finished.discard(transfer_id)
        arena = self._arena_pages.pop(transfer_id, None)
        if arena is not None:  # no write of the transfer can land: its arena pages may carry another
            self._give_back(arena)
        return True

    def _take(self, num_pages: int) -> list[int]:
        """Arena pages for a transfer, zeroed, tags and KV: a tag left by an earlier transfer never
        counts, and whatever this transfer does not write (a short WRITE still notified) reads as
        zeros, never an earlier transfer's KV, a late write of one into a free page included."""
        arena = self._free.take(num_pages)
        if is_active(Fault.SKIP_ARENA_ZEROING):
            self._tags[arena] = 0
        else:
            self._zero(arena)
        return arena

    def _give_back(self, arena: list[int]) -> None:
        """Zero a transfer's arena pages and free them: a holder of decode's NIXL metadata can READ
        the arena, so no page the transfer no longer holds keeps its tenant's KV."""
        if not is_active(Fault.SKIP_ARENA_ZEROING):
            self._zero(arena)
        self._free.give_back(arena)

    def _zero(self, arena: list[int]) -> None:
        """Tags and KV (every layer, K and V, every kv head) of `arena` pages to zeros."""
        zero_pages(self._tags.unsqueeze(0), arena)
        zero_pages(self._rows, arena)

    def _poll(self) -> None:
        for sender, messages in self._agent.get_new_notifs().items():
            for raw in messages:
                try:
                    note = _landed_decoder.decode(raw)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    logger.error("dropping an undecodable NIXL notification from %s", sender)
                    continue
                self._on_note(note)

    def _on_note(self, note: NixlLandedMsg) -> None:
        tid = note.transfer_id
        if tid not in self._pages and tid not in self._cancelling:
            return  # not (or no longer) a transfer of ours
        if tid in self._pages and tid not in self._notified and tid not in self._refused:
            why = self._import(note)
            if why is not None:
                self._refuse(note, why)
        parts = self._parts.setdefault(tid, set())
        parts.add(note.part)
        if len(parts) >= note.num_parts:
            self._notified.add(tid)

    def _import(self, note: NixlLandedMsg) -> str | None:
        """Copy what one WRITE wrote from the transfer's arena pages into its reservation's
        pages and record it; why it was refused (nothing recorded), or None."""
        tid = note.transfer_id
        pages, arena, landing = self._pages[tid], self._arena_pages[tid], self._landed[tid]
        why = self._check(note, landing, self._starts[tid])
        if why is not None:
            return why
        page_size = self._pool.page_size
        base = self._starts[tid] // page_size  # pages[i] holds page index base + i
        first = note.start // page_size - base
        spans = [(note.first_layer + i, -(-end // page_size) - base, end)
                 for i, end in enumerate(note.ends) if end > note.start]
        if not spans:
            return None
        tagged = self._tagged(arena[first:max(last for _, last, _ in spans)], tid)
        if not tagged():
            return "foreign_or_stale_write"
        copied: list[tuple[int, KVKind, int, int]] = []
        runs = RunsMemo()  # the layers of a part usually share their pages
        for layer, last, end in spans:
            for kind_index, (kind, target) in enumerate(zip(KINDS, (self._pool.k[layer], self._pool.v[layer]))):
                body = self._body[layer, kind_index]  # [kv_heads, num_pages, page_size, head_dim]
                body[:, arena[last - 1], end - (base + last - 1) * page_size:] = 0  # only [start, end) may land
                copy_pages(target, pages[first:last], body, arena[first:last], runs)
                copied.append((layer, kind, end, (last - first) * body[:, 0].numel() * body.element_size()))
        if not tagged():  # a write landed while we copied: the pages hold a mix; record nothing
            return "foreign_or_stale_write"
        for layer, kind, end, num_bytes in copied:
            landing.add(layer, kind, note.start, end, num_bytes)
        return None

    def _check(self, note: NixlLandedMsg, landing: Landing, start: int) -> str | None:
        layout = self._layout
        if not (0 <= note.first_layer and note.first_layer + len(note.ends) <= layout.num_layers
                and 0 <= note.part < note.num_parts):
            return "bad_block_address"
        # [0, start) is decode's prefix-cache hit: read-only pages no transfer may write
        if (note.start < start or note.start % layout.page_size
                or not all(e <= landing.num_positions for e in note.ends)):
            return "write_outside_reservation"
        return None

    def _tagged(self, arena_pages: list[int], transfer_id: str) -> Callable[[], bool]:
        """A check that every one of `arena_pages` carries the transfer's tag (asked before and after copying)."""
        tag, index = self._tags_of[transfer_id], torch.tensor(arena_pages, dtype=torch.int64)
        return lambda: bool((self._tags[index] == tag).all())

    def _refuse(self, note: NixlLandedMsg, why: str) -> None:
        self._refused.add(note.transfer_id)
        self.num_refused += 1
        logger.warning("refused the NIXL write of transfer %s: %s", note.transfer_id, why)

    def close(self) -> None:
        self._agent.deregister_memory(self._registration)


# ---- prefill -------------------------------------------------------------------------------


class NixlSender:
    name = NAME

    def __init__(self, agent_name: str, listen_host: str, timeout_s: float = PUSH_TIMEOUT_S,
                 num_parts: int = NUM_PARTS, max_direct_runs: int = MAX_DIRECT_RUNS) -> None:
        self._agent = make_agent(agent_name, listen_host)
        self._timeout_s = timeout_s
        self._num_parts = num_parts
        self._max_direct_runs = max_direct_runs
        self._remotes: dict[str, str] = {}  # decode's agent name -> NIXL's handle name for it
        self._pool: KVPool | None = None  # registered on the first push: the WRITEs read it in place
        self._pool_registration: Any = None
        self._staging: torch.Tensor | None = None  # tags, partial and gathered pages; registered, reused
        self._staging_registration: Any = None
        self.num_staged_pushes = 0  # pushes whose pages were gathered first (scattered pages)

    def push(self, plan: PushPlan, pool: KVPool) -> int:
        """WRITE the planned pages straight from the pool (scattered pages gathered first, the
        last page of each layer staged), in a few WRITEs whose notifications name what each
        wrote. Returns only once every WRITE is terminal (or raises `TransportError`, also only then)."""
        peer = decode_address(plan.kv_address)
        dest = self._dest(plan, pool, peer)
        remote = self._remote(peer)
        groups = self._groups(plan)
        if not groups:  # nothing to write: still say so
            self._notify(remote, peer, NixlLandedMsg(plan.transfer_id, plan.start, 0, [], 0, 1))
            return 0
        self._register(pool)
        writes = _Writes(plan, pool, peer, dest)
        gather = len(writes.runs) > self._max_direct_runs
        self.num_staged_pushes += gather
        writes.stage(self._buffer(writes.staging_bytes(gather)), gather)
        handles: list[Any] = []
        error: Exception | None = None
        try:
            for part, (first_layer, ends) in enumerate(groups):
                note = NixlLandedMsg(plan.transfer_id, plan.start, first_layer, ends, part, len(groups))
                handles.append(writes.post(self._agent, remote, note))
        except Exception as exc:  # nixl's own exception types (peer gone, connection refused)
            error = exc
        failed = self._wait(handles, peer)
        if error is not None or failed:
            self._forget(peer)
            raise TransportError(f"NIXL write to {peer.agent_name} failed: {error or failed}") from error
        return writes.num_bytes

    @staticmethod
    def _dest(plan: PushPlan, pool: KVPool, peer: NixlPeerMsg) -> list[int]:
        """Decode's arena pages for the plan's page indexes [start // page_size, last), checked."""
        if peer.layout != ArenaLayout.of(pool).key:
            raise TransportError(f"decode's KV layout is {peer.layout}, ours {ArenaLayout.of(pool).key}: "
                                 f"the engines differ")
        first = plan.start // pool.page_size
        last = max((plan.page_span(layer, pool.page_size)[1] for layer in range(len(plan.written))), default=0)
        if last <= first:
            return []
        if first < peer.first_page:
            raise TransportError(f"transfer {plan.transfer_id}: page {first} is before the reservation's first "
                                 f"writable page {peer.first_page}")
        dest = peer.arena_pages()[first - peer.first_page:last - peer.first_page]
        if len(dest) < last - first or not all(0 <= p < peer.num_pages for p in dest):
            raise TransportError(f"transfer {plan.transfer_id}: decode's address does not hold {last - first} "
                                 f"arena pages")
        return dest

    def _groups(self, plan: PushPlan) -> list[tuple[int, list[int]]]:
        """Layers in up to `num_parts` contiguous groups that send something: (first layer, ends).
        Each group about half the size of the one before (30 layers in 4: 16, 8, 4, 2): decode
        copies a group in while the next lands, so what is left once the last WRITE landed is
        the last group's copy, the smaller the better."""
        first, groups = 0, []
        for size in part_sizes(len(plan.written), self._num_parts):
            groups.append((first, plan.written[first:first + size]))
            first += size
        return [(first, ends) for first, ends in groups if any(end > plan.start for end in ends)]

    def _notify(self, remote: str, peer: NixlPeerMsg, note: NixlLandedMsg) -> None:
        try:
            self._agent.send_notif(remote, msgspec.msgpack.encode(note))
        except Exception as exc:
            self._forget(peer)
            raise TransportError(f"NIXL notification to {peer.agent_name} failed: {exc}") from exc

    def _register(self, pool: KVPool) -> None:
        """Register the pool once (prefill's own memory: only this agent's WRITEs read it)."""
        if self._pool is pool:
            return
        if self._pool is not None:
            self._agent.deregister_memory(self._pool_registration)
        tensors = [t for pair in zip(pool.k, pool.v) for t in pair]
        self._pool_registration, self._pool = self._agent.register_memory(tensors), pool

    def _buffer(self, num_bytes: int) -> torch.Tensor:
        """The registered staging buffer, grown (and registered again) when a push needs more."""
        if self._staging is None or self._staging.numel() < num_bytes:
            if self._staging is not None:
                self._agent.deregister_memory(self._staging_registration)
            self._staging = torch.empty(num_bytes, dtype=torch.uint8)
            self._staging_registration = self._agent.register_memory(self._staging)
        return self._staging[:num_bytes]

    def _wait(self, handles: list[Any], peer: NixlPeerMsg) -> str | None:
        """Wait until every WRITE is terminal and release it; the first failure, or None. Past
        the timeout, drop the connection (UCX then fails what it still holds) and keep waiting:
        NIXL reads prefill's pool until a WRITE is terminal, so returning earlier would let
        the request's pages be reused under a read."""
        deadline, failed = time.monotonic() + self._timeout_s, None
        for handle in handles:
            state = self._state(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    logger.error("a NIXL write to %s is not terminal after %g s: dropping the connection and "
                                 "waiting for it to end", peer.agent_name, self._timeout_s)
                    self._forget(peer)
                    deadline = time.monotonic() + self._timeout_s
                time.sleep(POLL_SLEEP_S)
                state = self._state(handle)
            self._release(handle)
            if state != "DONE" and failed is None:
                failed = f"state {state}"
        return failed

    def _state(self, handle: Any) -> str:
        try:
            return str(self._agent.check_xfer_state(handle))
        except Exception as exc:  # NIXL reports a failed transfer by raising
            logger.warning("a NIXL write ended with %s", exc)
            return "ERR"

    def _release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:  # a failed WRITE's handle may already be gone
            logger.warning("could not release a finished NIXL write: %s", exc)

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

    def close(self) -> None:
        for registration in (self._staging_registration, self._pool_registration):
            if registration is not None:
                self._agent.deregister_memory(registration)
        self._staging, self._pool = None, None


class _Writes:
    """The WRITEs of one push: descriptor rows for the tags, full pages (from prefill's pool in
    place, or gathered into staging) and partial last pages (staged) into decode's arena pages.

    Staging: `n` copies of the tag, then each layer's last page [layers, 2, kv_heads, page_size,
    head_dim], then, when gathered, the full pages [layers, 2, kv_heads, n, page_size, head_dim]."""

    def __init__(self, plan: PushPlan, pool: KVPool, peer: NixlPeerMsg, dest: list[int]) -> None:
        self._plan, self._pool, self._peer, self._dest = plan, pool, peer, dest
        self._layout = ArenaLayout.of(pool)
        self._remote_layout = ArenaLayout.of(pool, peer.num_pages)
        self._first = plan.start // pool.page_size  # dest[i] is the arena page of page index first + i
        self.runs = joint_runs(plan.src_pages[self._first:self._first + len(dest)], dest)
        self.num_bytes = 0
        self._gather_runs, self._row_runs = RunsMemo(), RunsMemo()  # every layer, K/V and head: the same pages
        self._staging: torch.Tensor | None = None
        self._gathered: torch.Tensor | None = None

    def staging_bytes(self, gather: bool) -> int:
        layout, n = self._layout, len(self._dest)
        blocks = layout.num_layers * 2 * layout.num_kv_heads
        return n * TAG_BYTES + blocks * layout.page_bytes + (blocks * n * layout.page_bytes if gather else 0)

    def _views(self, staging: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        layout, n = self._layout, len(self._dest)
        blocks = layout.num_layers * 2 * layout.num_kv_heads
        shape = (layout.num_layers, 2, layout.num_kv_heads)
        tags = staging[:n * TAG_BYTES].view(n, TAG_BYTES)
        partial_end = n * TAG_BYTES + blocks * layout.page_bytes
        partial = staging[n * TAG_BYTES:partial_end].view(layout.dtype).view(
            *shape, layout.page_size, layout.head_dim)
        if staging.numel() == partial_end:
            return tags, partial, None
        gathered = staging[partial_end:].view(layout.dtype).view(*shape, n, layout.page_size, layout.head_dim)
        return tags, partial, gathered

    def stage(self, staging: torch.Tensor, gather: bool) -> None:
        """Tags; each layer's last page when partial (zeros past what was written); with `gather`,
        the full pages in position order."""
        tags, partial, gathered = self._views(staging)
        plan, page_size = self._plan, self._pool.page_size
        tags[:] = tag_of(plan.transfer_id, plan.transfer_key)
        for layer, end in enumerate(plan.written):
            first, last = plan.page_span(layer, page_size)
            if first == last:
                continue
            full = end // page_size if end % page_size else last
            for kind_index, source in enumerate((self._pool.k[layer], self._pool.v[layer])):
                if gathered is not None and full > first:
                    copy_pages(gathered[layer, kind_index], list(range(first - self._first, full - self._first)),
                               source, plan.src_pages[first:full], self._gather_runs)
                if full < last:
                    copy_pages(partial[layer, kind_index].unsqueeze(1), [0], source, [plan.src_pages[last - 1]])
            if full < last:
                partial[layer, :, :, end - (last - 1) * page_size:] = 0  # nothing past `end`
        self._staging, self._gathered = staging, gathered

    def post(self, agent: Any, remote: str, note: NixlLandedMsg) -> Any:
        body = [row for i, end in enumerate(note.ends) for row in self._layer_rows(note.first_layer + i, end)]
        rows = self._tag_rows(note) + body
        local = np.array([(a, n, 0) for a, _, n in rows], dtype=np.uint64)
        remote_rows = np.array([(b, n, 0) for _, b, n in rows], dtype=np.uint64)
        handle = agent.initialize_xfer("WRITE", agent.get_xfer_descs(local, "DRAM"),
                                       agent.get_xfer_descs(remote_rows, "DRAM"), remote,
                                       msgspec.msgpack.encode(note))
        agent.transfer(handle)
        self.num_bytes += sum(n for _, _, n in rows)
        return handle

    def _tag_rows(self, note: NixlLandedMsg) -> list[tuple[int, int, int]]:
        assert self._staging is not None
        page_size = self._pool.page_size
        last = max((-(-end // page_size) for end in note.ends if end > note.start), default=self._first)
        local, arena = self._staging.data_ptr(), self._peer.arena_address
        return [(local + index * TAG_BYTES, arena + page * TAG_BYTES, count * TAG_BYTES)
                for index, page, count in page_runs(self._dest[:last - self._first])]

    def _layer_rows(self, layer: int, end: int) -> list[tuple[int, int, int]]:
        """(local address, remote address, bytes) for K and V of every head of one layer."""
        page_size, plan = self._pool.page_size, self._plan
        first, last = plan.page_span(layer, page_size)
        if first == last:
            return []
        full = end // page_size if end % page_size else last  # pages [first, full) are whole
        rows = []
        for kind_index, source in enumerate((self._pool.k[layer], self._pool.v[layer])):
            if layer == 0 and kind_index == 1 and is_active(Fault.SHORT_NIXL_WRITE):
                continue  # a test's short WRITE: layer 0's V left out, its notification unchanged
            for head in range(self._layout.num_kv_heads):
                rows += self._full_rows(source, layer, kind_index, head, first, full)
                if full < last:
                    rows.append(self._partial_row(layer, kind_index, head, last - 1))
        return rows

    def _full_rows(self, source: torch.Tensor, layer: int, kind_index: int, head: int, first: int,
                   full: int) -> list[tuple[int, int, int]]:
        """Pages [first, full) of one head: from the gathered copy, or runs of the pool in place."""
        page_bytes, base = self._layout.page_bytes, self._first
        dest = self._dest[first - base:full - base]
        if self._gathered is not None:
            head_address = self._gathered[layer, kind_index, head].data_ptr()
            src = list(range(first - base, full - base))
        else:
            # source: [kv_heads, num_pages, page_size, head_dim]
            head_address = source.data_ptr() + head * self._pool.num_pages * page_bytes
            src = self._plan.src_pages[first:full]
        arena = self._peer.arena_address
        return [(head_address + src[index] * page_bytes,
                 arena + self._remote_layout.block_offset(layer, kind_index, head, dest[index]), count * page_bytes)
                for index, count in self._row_runs(src, dest)]

    def _partial_row(self, layer: int, kind_index: int, head: int, index: int) -> tuple[int, int, int]:
        assert self._staging is not None
        layout, n = self._layout, len(self._dest)
        block = (layer * 2 + kind_index) * layout.num_kv_heads + head
        staged = self._staging.data_ptr() + n * TAG_BYTES + block * layout.page_bytes
        remote = self._peer.arena_address + self._remote_layout.block_offset(layer, kind_index, head,
                                                                             self._dest[index - self._first])
        return staged, remote, layout.page_bytes
