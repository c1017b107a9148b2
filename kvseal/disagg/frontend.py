"""The PD engine backend: `kvseal.engine_api.EngineBackend`, as the colocated `EngineClient`
is, over running prefill and decode engines.

Per request: ReserveMsg to the least-loaded decode engine; on `ReservedMsg`, PrefillMsg to
the least-loaded prefill engine; then decode's outputs (first token only after decode
verified the handoff) go to the request's handle. Every path ends the handle exactly once. A
request that ends before its PrefillMsg left is ended on decode with `AbortUnsentMsg` (no prefill
engine holds its transfer: decode frees the pages at once), after that with `AbortMsg`.

Admission (I1) uses the smallest `max_model_len` and pool of every engine (each reports them
in `EngineInfoMsg`); start-up warns when they differ and refuses engines whose KV layout or
model differ. Liveness: the client says `HelloMsg` to every engine every `HEARTBEAT_S`; an
engine silent for `DEAD_AFTER_S` is down: its requests fail at once (a decode engine's with
`EngineGone`; a prefill engine's are also aborted at their decode engine, which releases the
reservation), and `/health` answers 503 while a role has no engine up. An engine that answers
again, restarted at the same address or not, is used again without restarting the frontend.

Authentication (I9): every DEALER is a CURVE client proving the frontend's `--link-key` and
accepting only an engine that proves the public key configured for its address; a failed
handshake is logged with what to check, and the engine stays down.

Load and pool state: every engine reports `PdStatsMsg` (after changes and in answer to each
`HelloMsg`); `on_stats` gets the sum over the engines that are up, in the colocated engine's
`EngineStatsMsg` shape, so `/metrics`' `kvseal_kv_pages_used`/`_free` and the request gauges
mean the same in both modes (the canary's server evidence reads them). Its pages scrubbed is
the total over every engine instance this client has heard from (`CumulativeTotal`): it does
not drop when an engine goes down, nor when one restarts with its count back at 0.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, cast

import msgspec
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry
from zmq.utils.monitor import parse_monitor_message

from kvseal.disagg.link_auth import secure_client
from kvseal.disagg.link_keys import EngineEndpoint, KeyPair
from kvseal.disagg.metrics import PdMetrics
from kvseal.disagg.msgs import (
    INVALID_PREFILL_MSG,
    RESERVATION_UNCLAIMED,
    TRANSFER_FAILED,
    AbortUnsentMsg,
    EngineInfoMsg,
    HelloMsg,
    PdMsg,
    PdStatsMsg,
    PrefillDoneMsg,
    PrefillMsg,
    PrefillRefusedMsg,
    ReservedMsg,
    ReserveMsg,
    ReserveRefusedMsg,
    Role,
    decode,
    encode,
)
from kvseal.disagg.wire import tcp_endpoint
from kvseal.engine_api import (
    EngineGone,
    EngineUnavailable,
    IsolationBreach,
    RequestEvent,
    RequestHandle,
    RequestObserver,
    is_terminal,
)
from kvseal.errors import ConfigError
from kvseal.messages.msgs import (
    AbortMsg,
    AddRequestMsg,
    EngineReadyMsg,
    EngineStatsMsg,
    ForgetTenantMsg,
    OutputsMsg,
    RequestOutputMsg,
    RequestRejectedMsg,
)
from kvseal.totals import CumulativeTotal
from kvseal.types import ENGINE_UNAVAILABLE, HANDOFF_FAILED

logger = logging.getLogger("kvseal.server")

HEARTBEAT_S = 0.5
# A connected engine silent this long is hung (a dead one is noticed at once). An engine is
# silent for the whole of one step, and a full step's budget of prefill tokens on a loaded CPU
# host takes well over 15 s: this limit must exceed the longest step a healthy engine takes.
DEAD_AFTER_S = 60.0
START_TIMEOUT_S = 600.0
# What a link's monitor reports: its handshakes (done, or refused and why) and its disconnects.
LINK_EVENTS = (zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
               | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@dataclass
class EngineLink:
    """The frontend's DEALER to one engine, and what it knows about that engine."""

    role: Role
    address: str
    public_key: bytes  # the CURVE key the engine proves (prefill's link to decode checks it too)
    socket: zmq.asyncio.Socket
    monitor: zmq.asyncio.Socket  # the socket's connection events, attached before it connected
    info: EngineInfoMsg | None = None
    stats: PdStatsMsg | None = None
    last_seen_s: float = 0.0
    is_up: bool = False
    num_assigned: int = 0
    num_failed_handshakes: int = 0  # since the last one that succeeded (logged first, then every 100th)
    # tenants whose cache this engine must forget before it is used again (it was down when told)
    forgets_owed: set[str] = field(default_factory=set)
    down_reason: str | None = None  # why this frontend marked it down (clients are told), until it is up again

    @property
    def name(self) -> str:
        return self.info.instance_id if self.info is not None else self.address

    def send(self, msg: PdMsg) -> None:
        """Queue on the live connection, or raise `EngineUnavailable` (never queue for later)."""
        # A NOBLOCK send on an asyncio socket is attempted at once: the future is already done.
        sent = cast(asyncio.Future[None], self.socket.send(encode(msg), zmq.NOBLOCK))
        error = sent.exception() if sent.done() else None
        if error is not None:
            # clients see this: the role, not the address (the log says which engine went down)
            raise EngineUnavailable(f"the {self.role} engine is not connected")


class EngineSupervisor(Protocol):
    """The engines a frontend started itself and keeps running (`kvseal.disagg.serve`)."""

    def why_down(self, role: Role) -> str | None:
        """What the supervisor knows of a `role` engine that is not up: exited, restarting, given up,
        restarted and not answered yet; None when it knows nothing newer than the engine's answer."""
        ...

    def answered(self, role: Role) -> None:
        """A `role` engine introduced itself: what the supervisor said of its restart is history."""
        ...

    def add_metrics(self, registry: CollectorRegistry) -> None: ...

    def stop(self) -> None:
        """Stop every engine (blocking)."""
        ...


@dataclass
class PdRoute:
    """Where one request is: its engines, transfer id and stage (for routing and the audit)."""

    handle: RequestHandle
    msg: AddRequestMsg
    decode: EngineLink
    prefill: EngineLink | None = None
    transfer_id: str | None = None
    is_aborted: bool = False
    started_decoding: bool = False
    prefill_refusal: PrefillRefusedMsg | None = None  # prefill's own end of it, while decode has not reported

    @property
    def is_prefill_asked(self) -> bool:
        """Whether a PrefillMsg for it may have left this frontend: one is sent the moment decode's
        reservation (its transfer id) is taken here, never before; until then only decode and
        this frontend know the transfer."""
        return self.transfer_id is not None


@dataclass(frozen=True)
class PdLimits:
    max_model_len: int
    kv_cache_tokens: int


def smallest_limits(infos: list[EngineInfoMsg]) -> PdLimits:
    """I1 with several engines: the smallest of every engine's limits."""
    return PdLimits(min(i.max_model_len for i in infos), min(i.kv_cache_tokens for i in infos))


def scrub_policy(infos: list[EngineInfoMsg]) -> str:
    """The engines' common scrub policy (I7), or each role's where they differ ("decode=off,prefill=free")."""
    policies = {i.kv_scrub_policy for i in infos}
    if len(policies) == 1:
        return policies.pop()
    return ",".join(sorted({f"{i.role}={i.kv_scrub_policy}" for i in infos}))


class PdClient:
    def __init__(self, prefill: list[EngineEndpoint], decode: list[EngineEndpoint], tokenizer_path: str,
                 link_key: KeyPair, supervisor: EngineSupervisor | None = None) -> None:
        """`supervisor`: the engines this frontend started (`serve --pd`), stopped last in `shutdown`."""
        self._ctx = zmq.asyncio.Context()
        self._frontend_id = secrets.token_hex(4)
        self._link_key = link_key
        self.links = [self._link("prefill", a) for a in prefill] + [self._link("decode", a) for a in decode]
        self._tokenizer_path = tokenizer_path
        self._supervisor = supervisor
        self._on_link_stats: Callable[[EngineLink], None] = lambda link: None  # per-engine gauges
        self._routes: dict[str, PdRoute] = {}
        # tenants this frontend had the engines forget while a request of theirs waited for prefill:
        # a prefill engine that restarts is told again while such requests wait (`_owed_on_restart`);
        # a name is dropped once none does (at most one name per request in flight)
        self._forgotten: set[str] = set()
        self._by_transfer: dict[str, PdRoute] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._round_robin = itertools.count()
        self._is_shutting_down = False
        self._layout: str | None = None
        self._ready: EngineReadyMsg | None = None
        # Told the new limits when an engine (re)starts with different ones (the server admits with them).
        self.on_ready_change: Callable[[EngineReadyMsg], None] | None = None
        # Told the summed load of the engines that are up whenever one reports or goes down.
        self.on_stats: Callable[[EngineStatsMsg], None] | None = None
        self._pages_scrubbed = CumulativeTotal()  # over engine instances (a restart is a new one)
        self._preemptions = CumulativeTotal()  # the same, for vllm:num_preemptions_total

    def _link(self, role: Role, engine: EngineEndpoint) -> EngineLink:
        socket = self._ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.IMMEDIATE, 1)
        socket.setsockopt(zmq.LINGER, 0)
        secure_client(socket, self._link_key, engine.public_key)
        # Before connecting: a handshake can end (a refused key, never retried) before `start` runs,
        # and a monitor attached after it would never hear of it.
        monitor = socket.get_monitor_socket(LINK_EVENTS)
        socket.connect(tcp_endpoint(engine.address))
        return EngineLink(role, engine.address, engine.public_key, socket, monitor)

    # ---- the EngineBackend interface ------------------------------------------------------

    def add_metrics(self, registry: CollectorRegistry) -> None:
        """Per-engine handoff gauges (`kvseal_pd_*`), from each engine's `PdStatsMsg`."""
        self._on_link_stats = PdMetrics(registry).record
        if self._supervisor is not None:
            self._supervisor.add_metrics(registry)

    @property
    def engine_pids(self) -> str:
        return ", ".join(f"{role} engine pid{'s' if len(pids) > 1 else ''} {', '.join(pids)}"
                         for role in ("prefill", "decode")
                         if (pids := [str(link.info.pid) for link in self.links
                                      if link.role == role and link.info is not None]))

    @property
    def is_available(self) -> bool:
        return self.failure is None

    @property
    def failure(self) -> str | None:
        if self._is_shutting_down:
            return "the server is shutting down"
        for role in ("prefill", "decode"):
            if not self._is_role_up(role):
                return self._unreachable(role)
        return None

    def _is_role_up(self, role: Role) -> bool:
        return any(link.is_up for link in self.links if link.role == role)

    def _unreachable(self, role: Role) -> str:
        """What clients are told while no `role` engine is up, as things are now: the supervisor's
        word on the process it started (exited, restarting, given up, not answered since its
        restart), else why this frontend marked the engine down (silent since, disconnected)."""
        why = self._supervisor.why_down(role) if self._supervisor is not None else None
        if why is None:
            why = "; ".join(dict.fromkeys(link.down_reason for link in self.links
                                          if link.role == role and link.down_reason is not None)) or None
        return f"no {role} engine is reachable" + (f" ({why})" if why else "")

    @property
    def num_in_flight(self) -> int:
        return len(self._routes)

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> EngineReadyMsg:
        """Wait until every configured engine has introduced itself; check they can work together."""
        self._tasks = [asyncio.create_task(self._receive_loop(link)) for link in self.links]
        self._tasks += [asyncio.create_task(self._watch_connection(link)) for link in self.links]
        self._tasks.append(asyncio.create_task(self._heartbeat_loop()))
        deadline = time.monotonic() + timeout_s
        while any(link.info is None for link in self.links):
            if time.monotonic() > deadline:
                missing = [link.address for link in self.links if link.info is None]
                raise ConfigError(f"no answer within {timeout_s:g} s from the engines at {', '.join(missing)}; "
                                  f"start them with `kvseal engine --role ... --listen HOST:PORT`, and check the "
                                  f"keys: each engine's --frontend-keys must list this frontend's public key, and "
                                  f"--prefill-keys/--decode-keys must be the engines' own public keys")
            await asyncio.sleep(0.05)
        self._ready = self._ready_msg()
        return self._ready

    def _ready_msg(self) -> EngineReadyMsg:
        infos = [link.info for link in self.links if link.info is not None]
        limits = smallest_limits(infos)
        if len({(i.max_model_len, i.kv_cache_tokens) for i in infos}) > 1:
            logger.warning("the engines' limits differ (%s); admitting against the smallest: max_model_len=%d "
                           "kv_cache_tokens=%d", ", ".join(f"{i.role}@{i.address}: max_model_len="
                                                           f"{i.max_model_len} kv_cache_tokens={i.kv_cache_tokens}"
                                                           for i in infos),
                           limits.max_model_len, limits.kv_cache_tokens)
        first = next(i for i in infos if i.role == "decode")
        return EngineReadyMsg(
            pid=first.pid, model_name=first.model_name, model_path=first.model_path,
            tokenizer_path=self._tokenizer_path, architecture=first.architecture,
            max_model_len=limits.max_model_len, kv_cache_tokens=limits.kv_cache_tokens, vocab_size=first.vocab_size,
            page_size=first.page_size, num_pages=min(i.num_pages for i in infos),
            kv_scrub_policy=scrub_policy(infos),
        )

    def submit(self, msg: AddRequestMsg, observer: RequestObserver) -> RequestHandle:
        """Reserve on the least-loaded decode engine; `EngineUnavailable` when either role has no
        engine up (no reservation is made for a request no prefill engine could take)."""
        decode_link = self._pick("decode")
        if not self._is_role_up("prefill"):
            raise EngineUnavailable(self._unreachable("prefill"))
        handle = RequestHandle(msg.request_id, msg.tenant, observer)
        route = PdRoute(handle, msg, decode_link)
        decode_link.send(ReserveMsg(msg.request_id, msg.tenant, msg.prompt_token_ids, msg.params))
        decode_link.num_assigned += 1
        self._routes[msg.request_id] = route
        route.handle.route["decode_engine"] = decode_link.name
        return handle

    def abort(self, request_id: str, tenant: str, reason: str) -> None:
        route = self._routes.get(request_id)
        if route is None or route.handle.tenant != tenant:
            return
        route.is_aborted = True
        if route.decode.is_up:
            self._abort_on_decode(route, reason)
        if route.prefill is not None and route.prefill.is_up:
            self._try_send(route.prefill, AbortMsg(request_id, tenant, reason))

    def _abort_on_decode(self, route: PdRoute, reason: str) -> None:
        """Tell the request's decode engine to end it. Before a PrefillMsg could leave for it (and
        none does after this: the request is aborted or ended here) that is `AbortUnsentMsg`, so
        decode frees its reservation at once: no prefill engine has the transfer to write."""
        request_id, tenant = route.handle.request_id, route.handle.tenant
        abort = AbortMsg if route.is_prefill_asked else AbortUnsentMsg
        self._try_send(route.decode, abort(request_id, tenant, reason))

    def abort_all(self, reason: str) -> None:
        for route in list(self._routes.values()):
            self.abort(route.handle.request_id, route.handle.tenant, reason)

    def forget_tenant(self, tenant: str) -> int:
        """Every engine, both roles (each keeps a prefix cache), forgets the tenant now, or, if it
        is down, before it is used again. A prefill engine is also told which of the tenant's
        requests are reserved and not yet sent to prefill: their `PrefillMsg` comes after this, and
        they are the old tenant's."""
        num_told = 0
        if self._waits_for_prefill(tenant):  # otherwise no restart can find a request to keep apart
            self._forgotten.add(tenant)
        for link in self.links:
            if link.is_up:
                num_told += self._send_forget(link, tenant)
            else:
                link.forgets_owed.add(tenant)
        return num_told

    def _send_forget(self, link: EngineLink, tenant: str) -> int:
        ahead = [] if link.role == "decode" else [
            request_id for request_id, route in self._routes.items()
            if route.handle.tenant == tenant and route.prefill is None and not route.is_aborted]
        try:
            link.send(ForgetTenantMsg(tenant, ahead))
        except EngineUnavailable:  # it went away just now: told when it answers again
            link.forgets_owed.add(tenant)
            return 0
        return 1

    def _owed_on_restart(self, link: EngineLink) -> set[str]:
        """The forgets a restarted prefill engine must hear again: a new process counts every
        tenant's cache epoch from 0, so a request of a forgotten tenant reserved before its forget
        and not yet sent to prefill would share the namespace of the name's new holder there. Told
        again, with those requests named (`_send_forget`), it keeps them apart; a request of the new
        holder among them is only kept off the cache."""
        if link.role != "prefill":
            return set()
        return {tenant for tenant in self._forgotten if self._waits_for_prefill(tenant)}

    def _waits_for_prefill(self, tenant: str) -> bool:
        """Whether a request of `tenant` in flight is not with a prefill engine (not yet sent to one)."""
        return any(route.handle.tenant == tenant and route.prefill is None and not route.is_aborted
                   for route in self._routes.values())

    def _pay_forgets(self, link: EngineLink) -> None:
        """Before an engine that was down is used again: the forgets it missed, in one go."""
        for tenant in sorted(link.forgets_owed):
            link.forgets_owed.discard(tenant)
            self._send_forget(link, tenant)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        self._is_shutting_down = True
        self.abort_all("server_shutdown")
        deadline = time.monotonic() + timeout_s
        while self._routes and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for route in list(self._routes.values()):
            self._end(route, EngineGone("the server is shutting down"))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for link in self.links:
            link.monitor.close(linger=0)  # (closed already where `start` watched it: closing again is nothing)
            link.socket.close(linger=0)
        self._ctx.term()
        if self._supervisor is not None:
            self._supervisor.stop()

    # ---- routing ----------------------------------------------------------------------------

    def _pick(self, role: Role) -> EngineLink:
        """The least-loaded engine of `role` that is up (ties: round robin)."""
        if self._is_shutting_down:
            raise EngineUnavailable("the server is shutting down")
        up = [link for link in self.links if link.role == role and link.is_up]
        if not up:
            raise EngineUnavailable(self._unreachable(role))
        turn = next(self._round_robin)
        return min(up, key=lambda link: (link.num_assigned, (up.index(link) - turn) % len(up)))

    async def _receive_loop(self, link: EngineLink) -> None:
        while True:
            data = await link.socket.recv()
            try:
                msg = decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                logger.error("dropping an undecodable message from %s: %s", link.address, exc)
                continue
            try:
                self._on_msg(link, msg)
            except Exception:  # a frontend bug: fail closed, nothing may wait forever
                logger.critical("routing a message from %s failed; failing every request", link.address,
                                exc_info=True)
                for route in list(self._routes.values()):
                    reason = "the frontend failed while routing engine messages"
                    self._abort_on_decode(route, reason)
                    self._end(route, EngineGone(reason))

    def _on_msg(self, link: EngineLink, msg: PdMsg) -> None:
        link.last_seen_s = time.monotonic()
        match msg:
            case EngineInfoMsg():
                self._on_info(link, msg)
            case PdStatsMsg():
                link.stats = msg
                self._pages_scrubbed.observe(msg.instance_id, msg.engine.num_pages_scrubbed)
                self._preemptions.observe(msg.instance_id, msg.engine.num_preemptions)
                self._on_link_stats(link)
                self._report_load()
            case ReservedMsg():
                self._on_reserved(link, msg)
            case ReserveRefusedMsg():
                self._on_terminal(link, RequestRejectedMsg(msg.request_id, msg.tenant, msg.code, msg.message,
                                                           msg.param, msg.http_status))
            case OutputsMsg():
                for out in msg.outputs:
                    self._on_output(link, out)
            case RequestRejectedMsg():
                self._on_terminal(link, msg)
            case PrefillDoneMsg() | PrefillRefusedMsg():
                self._on_prefill_result(link, msg)
            case _:
                logger.error("unexpected %s from %s; dropped", type(msg).__name__, link.address)

    def _on_info(self, link: EngineLink, info: EngineInfoMsg) -> None:
        if info.role != link.role:
            logger.error("the engine at %s is a %s engine, configured as %s; not using it", link.address,
                         info.role, link.role)
            return
        if self._layout is None:
            self._layout = info.kv_layout
        if info.kv_layout != self._layout:
            logger.error("the engine at %s has KV layout %s, the others %s; not using it", link.address,
                         info.kv_layout, self._layout)
            return
        if link.info is not None and link.info.instance_id != info.instance_id:
            logger.warning("the %s engine at %s restarted (%s -> %s)", link.role, link.address,
                           link.info.instance_id, info.instance_id)
            self._engine_down(link, f"the {link.role} engine restarted")
            link.forgets_owed |= self._owed_on_restart(link)
        if not link.is_up:
            self._pay_forgets(link)  # before it is up: nothing submitted later can overtake them
            logger.info("%s engine %s is up at %s", link.role, info.instance_id, link.address)
            if self._supervisor is not None:
                self._supervisor.answered(link.role)
        changed = link.info != info
        link.info, link.is_up, link.down_reason = info, True, None
        if changed:
            self._refresh_ready()

    def _refresh_ready(self) -> None:
        """An engine (re)started: admit with the smallest limits of the engines as they are now (I1)."""
        if self._ready is None or any(link.info is None for link in self.links):
            return  # still starting: `start` reads them all
        ready = self._ready_msg()
        if (ready.max_model_len, ready.kv_cache_tokens) != (self._ready.max_model_len, self._ready.kv_cache_tokens):
            logger.warning("the engines' limits changed: admitting against max_model_len=%d kv_cache_tokens=%d "
                           "(was %d, %d)", ready.max_model_len, ready.kv_cache_tokens, self._ready.max_model_len,
                           self._ready.kv_cache_tokens)
        self._ready = ready
        if self.on_ready_change is not None:
            self.on_ready_change(ready)

    def _on_reserved(self, link: EngineLink, msg: ReservedMsg) -> None:
        route = self._routes.get(msg.request_id)
        if route is None or route.decode is not link or route.is_aborted:
            # no PrefillMsg names this transfer, nor ever will: decode frees it at once (an abort
            # that reached it first keeps its end)
            self._try_send(link, AbortUnsentMsg(msg.request_id, msg.tenant, RESERVATION_UNCLAIMED))
            return
        route.transfer_id = msg.transfer_id
        route.handle.route["transfer_id"] = msg.transfer_id
        self._by_transfer[msg.transfer_id] = route
        try:
            prefill = self._pick("prefill")
            p = route.msg
            prefill.send(PrefillMsg(p.request_id, p.tenant, p.prompt_token_ids, p.params, msg.transfer_id,
                                    link.address, link.public_key, link.name, msg.kv_address, msg.transfer_key,
                                    msg.pages, msg.num_cached_tokens))
        except EngineUnavailable as exc:  # not sent: no prefill engine has the transfer
            self._try_send(link, AbortUnsentMsg(msg.request_id, msg.tenant, str(exc)))
            self._end(route, EngineGone(str(exc)))
            return
        prefill.num_assigned += 1
        route.prefill = prefill
        route.handle.route["prefill_engine"] = prefill.name

    def _on_output(self, link: EngineLink, out: RequestOutputMsg) -> None:
        route = self._routes.get(out.request_id)
        if route is None or route.decode is not link:
            return  # a request this frontend already ended (its engine was declared down)
        if out.tenant != route.handle.tenant:
            logger.error("decode %s reported tenant %r for request %s of tenant %r; failing it closed",
                         link.address, out.tenant[:64], out.request_id, route.handle.tenant)
            self.abort(out.request_id, route.handle.tenant, "isolation_check_failed")
            self._end(route, IsolationBreach(f"frontend tenant check: decode reported tenant '{out.tenant[:64]}' "
                                             f"for request {out.request_id} of tenant '{route.handle.tenant}'"))
            return
        route.started_decoding = route.started_decoding or bool(out.new_token_ids)
        if is_terminal(out):
            self._end(route, _prefills_own(route, out) or _as_engine_loss(out))
        else:
            route.handle.deliver(out)

    def _on_terminal(self, link: EngineLink, event: RequestRejectedMsg) -> None:
        route = self._routes.get(event.request_id)
        if route is not None and route.decode is link and event.tenant == route.handle.tenant:
            self._end(route, _as_engine_loss(event))

    def _on_prefill_result(self, link: EngineLink, msg: PrefillDoneMsg | PrefillRefusedMsg) -> None:
        route = self._by_transfer.get(msg.transfer_id)
        if route is None or route.prefill is not link:
            return
        self._release_prefill(route)
        if isinstance(msg, PrefillRefusedMsg) and msg.code in (TRANSFER_FAILED, INVALID_PREFILL_MSG):
            # Decode may never have heard of it (prefill could not reach it): end the reservation
            # there too, and the request here as what it is, the engines' failure (502, its code):
            # decode's answer to a plain abort would read as an abort.
            self._try_send(route.decode, AbortMsg(route.handle.request_id, route.handle.tenant, msg.message))
            self._end(route, RequestRejectedMsg(route.handle.request_id, route.handle.tenant, msg.code, msg.message,
                                                None, 502))
        elif isinstance(msg, PrefillRefusedMsg):  # decode relays it, unless prefill's word never reached it
            route.prefill_refusal = msg

    def _release_prefill(self, route: PdRoute) -> None:
        if route.prefill is not None:
            route.prefill.num_assigned -= 1
            route.prefill = None

    def _end(self, route: PdRoute, event: RequestEvent) -> None:
        """End the request here, once. A prefill engine that has not reported its job's end may
        still hold it (queued, computing, about to push): it is told to abort, whatever ended the
        request (decode's expiry or refusal, an engine down), so it computes nothing more for it
        and frees its pages. Decode's side is its caller's: decode reported the end, or was told."""
        request_id = route.handle.request_id
        if self._routes.pop(request_id, None) is None:
            return
        route.decode.num_assigned -= 1
        if route.transfer_id is not None:
            self._by_transfer.pop(route.transfer_id, None)
        if route.prefill is not None and route.prefill.is_up and not route.is_aborted:  # (`abort` told it)
            self._try_send(route.prefill, AbortMsg(request_id, route.handle.tenant, _ended_because(event)))
        self._release_prefill(route)
        if route.handle.tenant in self._forgotten and not self._waits_for_prefill(route.handle.tenant):
            self._forgotten.discard(route.handle.tenant)  # no request from before its forget is left
        route.handle.deliver(event)

    def load(self) -> EngineStatsMsg:
        """The engines' load and pools, summed over those that are up (a down engine's are unknown)."""
        stats = [link.stats.engine for link in self.links if link.is_up and link.stats is not None]
        return EngineStatsMsg(sum(s.num_running for s in stats), sum(s.num_waiting for s in stats),
                              sum(s.num_pages_used for s in stats), sum(s.num_pages_free for s in stats),
                              sum(s.num_preemptions for s in stats), sum(s.num_isolation_violations for s in stats),
                              self._pages_scrubbed.total, *_grammar_totals(stats),
                              num_preemptions_total=self._preemptions.total)

    def _report_load(self) -> None:
        if self.on_stats is not None:
            self.on_stats(self.load())

    @staticmethod
    def _try_send(link: EngineLink, msg: PdMsg) -> None:
        try:
            link.send(msg)
        except EngineUnavailable:
            pass  # that engine is down: it holds nothing of this request any more

    # ---- liveness -----------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        hello = HelloMsg(self._frontend_id)
        while True:
            for link in self.links:
                self._try_send(link, hello)
            self._mark_silent_down(time.monotonic())
            await asyncio.sleep(HEARTBEAT_S)

    def _mark_silent_down(self, now_s: float) -> None:
        """Every engine that is up and has said nothing for `DEAD_AFTER_S` is down; its reason says
        since when (true for as long as it stays silent, unlike a duration)."""
        for link in self.links:
            silent_s = now_s - link.last_seen_s
            if link.is_up and silent_s > DEAD_AFTER_S:
                logger.error("the %s engine at %s has not answered for %.1f s: marking it down", link.role,
                             link.address, silent_s)
                since = time.strftime("%H:%M:%S", time.gmtime(time.time() - silent_s))
                self._engine_down(link, f"the {link.role} engine has not answered since {since} UTC")

    async def _watch_connection(self, link: EngineLink) -> None:
        """A disconnect (the engine process died or closed) marks the engine down at once; a
        completed handshake says hello at once; a failed one is logged with what to check."""
        monitor = link.monitor
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED and link.is_up:
                    logger.error("the %s engine at %s disconnected: marking it down", link.role, link.address)
                    self._engine_down(link, f"the {link.role} engine disconnected")
                elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    link.num_failed_handshakes = 0
                    self._try_send(link, HelloMsg(self._frontend_id))
                elif event["event"] != zmq.EVENT_DISCONNECTED:
                    self._log_refused_handshake(link, event["event"])
        finally:
            link.socket.disable_monitor()
            monitor.close(linger=0)

    def _log_refused_handshake(self, link: EngineLink, event: int) -> None:
        """ZMQ retries a failed handshake every ~100 ms (one its peer refused by ZAP, never):
        the first failure is logged, then every 100th."""
        link.num_failed_handshakes += 1
        if link.num_failed_handshakes % 100 != 1:
            return
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            logger.error("the %s engine at %s refused this frontend's key %s: add it to that engine's "
                         "--frontend-keys, then restart this frontend (ZMQ does not retry a refused key)",
                         link.role, link.address, self._link_key.public.decode())
        else:
            logger.error("the CURVE handshake with the %s engine at %s failed (%d times): does that engine prove the "
                         "public key %s given for it (--%s-keys), and is it a kvseal engine?", link.role,
                         link.address, link.num_failed_handshakes, link.public_key.decode(), link.role)

    def _engine_down(self, link: EngineLink, reason: str) -> None:
        """Fail every request that depends on `link` now; free what other engines hold for them.
        `reason` reaches clients: it names the role, never the address (the log line before does)."""
        link.is_up, link.down_reason = False, reason
        link.stats = None
        self._on_link_stats(link)
        self._report_load()
        for route in list(self._routes.values()):
            if route.decode is link:
                self._end(route, EngineGone(reason))  # which aborts it on its prefill engine
            elif route.prefill is link and not route.started_decoding:
                self._try_send(route.decode, AbortMsg(route.handle.request_id, route.handle.tenant, reason))
                self._end(route, EngineGone(reason))


def _as_engine_loss(event: RequestOutputMsg | RequestRejectedMsg) -> RequestEvent:
    """An engine's end of a request because the engine itself was lost (a tensor-parallel rank
    died: `ENGINE_UNAVAILABLE`, decode's own or prefill's relayed) is `EngineGone`, as when the
    process dies: 503 `engine_unavailable`, audited as an error, never a rejection of the request
    (what it generated so far is counted from its outputs). Any other event as it is."""
    if isinstance(event, RequestRejectedMsg) and event.code == ENGINE_UNAVAILABLE:
        return EngineGone(event.message)
    if isinstance(event, RequestOutputMsg) and event.error_code == ENGINE_UNAVAILABLE:
        return EngineGone(event.error or "the engine was lost")
    return event


def _prefills_own(route: PdRoute, out: RequestOutputMsg) -> RequestRejectedMsg | None:
    """Prefill's refusal of the request, when decode ends it as a failed handoff (it expired the
    reservation: prefill's `TransferAbortMsg` never reached it) after prefill told this frontend
    it refused the request itself: the client gets prefill's code and status (a 4xx for its own
    fault), not a handoff failure to retry. None for every other end, and after an abort."""
    refusal = route.prefill_refusal
    if refusal is None or out.error_code != HANDOFF_FAILED or route.is_aborted:
        return None
    return RequestRejectedMsg(out.request_id, out.tenant, refusal.code, refusal.message, refusal.param,
                              refusal.http_status)


def _ended_because(event: RequestEvent) -> str:
    """The reason a prefill engine is given for the abort of a request the frontend ended."""
    if isinstance(event, RequestOutputMsg):
        return f"the request ended on decode: {event.error or event.finish_reason or 'ended'}"
    if isinstance(event, RequestRejectedMsg):
        return f"the request was refused on decode: {event.message}"
    return f"the request ended: {event.message}"


def _grammar_totals(stats: list[EngineStatsMsg]) -> tuple[int, int, int, int, int]:
    """The engines' grammar compile figures, summed (each role compiles a request's grammar)."""
    return (sum(s.num_grammar_workers_ready for s in stats), sum(s.num_grammar_compiles_running for s in stats),
            sum(s.num_grammar_compiles_queued for s in stats), sum(s.num_grammar_compile_timeouts for s in stats),
            sum(s.num_grammar_compiles_cancelled for s in stats))
