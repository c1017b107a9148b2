"""Who may talk to an engine, and what each may say (I9).

Two gates, both on the engine's one ROUTER:

1. **Authentication, at the handshake.** The ROUTER is a CURVE server (`secure_server`) whose
   ZAP handler (pyzmq's `ThreadAuthenticator`, one per engine) lets a client finish the
   handshake only if its public key is on one of the engine's allow-lists. A client with any
   other key, or with none (plain ZMQ), never completes it: the engine reads no byte of it, so
   it answers nothing, not even a hello. `ZAP_ENFORCE_DOMAIN` makes a missing ZAP handler
   refuse everyone rather than accept everyone (libzmq's default). Every refused handshake is
   counted by reason: ZAP's (`unlisted_key`), and those that fail before ZAP is asked, which the
   ROUTER's monitor reports (`HANDSHAKE_REASONS`: a plain-ZMQ client fails on the mechanism).
   They are logged at most once per `REFUSAL_LOG_INTERVAL_S`, so a flood cannot fill the log.
2. **Authorization, per message.** libzmq tags every message of a connection with the
   `User-Id` the ZAP handler gave it (here: the client's public key); `identify` maps it to a
   `LinkIdentity` (`frontend:NAME` or `peer:NAME`), and `allows` lets each role send only its
   own messages: a frontend reserves, prefills, aborts requests, says hello, reads integrity
   and shuts the engine down; a peer (a prefill engine, on decode) sends KV, commits and
   transfer aborts. A message outside its sender's role is dropped, logged and counted.

So the tenant an engine acts on (`ReserveMsg`, `PrefillMsg`), and with it the cache namespace
the engine derives from it, comes only from an authenticated frontend, and commits only from
an authenticated prefill engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from kvseal._testing.faults import Fault, is_active
from kvseal.disagg.link_keys import EngineLinkKeys, KeyPair
from kvseal.disagg.msgs import (
    AbortUnsentMsg,
    CommitMsg,
    HelloMsg,
    IntegrityCheckMsg,
    KVBlockMsg,
    PdMsg,
    PrefillMsg,
    ReserveMsg,
    TransferAbortMsg,
    TransferKeepaliveMsg,
)
from kvseal.errors import ConfigError
from kvseal.messages.msgs import AbortMsg, ForgetTenantMsg, ShutdownMsg

logger = logging.getLogger("kvseal.disagg")

LinkRole = Literal["frontend", "peer"]

# What each role may send to an engine; everything else from it is refused.
MESSAGES_OF: dict[LinkRole, tuple[type, ...]] = {
    "frontend": (HelloMsg, IntegrityCheckMsg, ShutdownMsg, ReserveMsg, PrefillMsg, AbortMsg, AbortUnsentMsg,
                 ForgetTenantMsg),
    "peer": (KVBlockMsg, CommitMsg, TransferKeepaliveMsg, TransferAbortMsg),
}


@dataclass(frozen=True)
class LinkIdentity:
    role: LinkRole
    name: str

    def __str__(self) -> str:
        return f"{self.role}:{self.name}"


# The handshake failures the ROUTER's monitor reports: those that end before ZAP is asked. ZAP's own
# refusals (EVENT_HANDSHAKE_FAILED_AUTH) are counted by `LinkGuard.callback`, with the key.
MONITORED_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
HANDSHAKE_REASONS = {
    "unlisted_key": "a CURVE client whose key is on no allow-list (ZAP refused it)",
    "not_curve": "a client of another ZMQ mechanism (plain ZMQ: NULL, or PLAIN)",
    "bad_crypto": "a CURVE client whose handshake does not decrypt (it expects another server key)",
    "protocol_error": "a client that broke the ZMTP handshake otherwise",
    "incomplete": "a connection closed or timed out before its handshake ended (a port probe)",
}
REFUSAL_LOG_INTERVAL_S = 10.0


def handshake_refusal(event: int, value: int) -> str:
    """The reason (a key of `HANDSHAKE_REASONS`) of a failed handshake the monitor reported."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        return "incomplete"  # `value` is an errno
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "not_curve"
    if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "bad_crypto"
    return "protocol_error"


class RefusalLog:
    """Refused handshakes in the log, at most one line per `interval_s`: the first of a window
    with its detail, the next one also saying how many went unlogged in between."""

    def __init__(self, interval_s: float = REFUSAL_LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._quiet_until_s: float | None = None
        self._num_unlogged = 0

    def refused(self, domain: str, detail: str) -> None:
        """One refusal on `domain` (callers hold the guard's lock: the ZAP thread logs too)."""
        now_s = self.clock()
        if self._quiet_until_s is not None and now_s < self._quiet_until_s:
            self._num_unlogged += 1
            return
        unlogged, self._num_unlogged = self._num_unlogged, 0
        self._quiet_until_s = now_s + self.interval_s
        logger.warning("refused a handshake on %s: %s%s", domain, detail,
                       f" ({unlogged} more refused since the last such line, not logged; at most one line per "
                       f"{self.interval_s:g} s, every one counted in kvseal_pd_link_refusals)" if unlogged else "")


# What a key on no allow-list is taken for while `Fault.OPEN_ENGINE_LINKS` is on (tests only).
_STRANGER = LinkIdentity("frontend", "unlisted")


def secure_client(socket: zmq.Socket, own: KeyPair, server_key: bytes) -> None:
    """Make `socket` (before it connects) a CURVE client: it proves `own` and accepts only a
    server that proves `server_key`."""
    socket.curve_secretkey = own.secret
    socket.curve_publickey = own.public
    socket.curve_serverkey = server_key


class LinkGuard:
    """One engine's gates: its ZAP handler and its per-message role check.

    One per engine and per ZMQ context (a context has one ZAP endpoint); `close` stops it."""

    def __init__(self, ctx: zmq.Context, keys: EngineLinkKeys, domain: str) -> None:
        self.keys = keys
        self.domain = domain
        self._identities = {k.key: LinkIdentity("frontend", k.name) for k in keys.frontends}
        self._identities |= {k.key: LinkIdentity("peer", k.name) for k in keys.peers}
        self._lock = threading.Lock()  # the counters are written by the ZAP thread and the engine's
        self.refused_handshakes: Counter[str] = Counter()  # by reason (`HANDSHAKE_REASONS`)
        self.num_refused_messages = 0
        self.refusal_log = RefusalLog()
        self._monitor: zmq.Socket | None = None  # made by `secure_server`
        self._authenticator = ThreadAuthenticator(ctx, log=logging.getLogger("kvseal.disagg.zap"))
        try:
            self._authenticator.start()
        except zmq.ZMQError as exc:
            raise ConfigError(f"cannot start the engine's ZAP handler: {exc} (one engine per ZMQ context)") from exc
        self._authenticator.configure_curve_callback(domain, self)

    def secure_server(self, router: zmq.Socket) -> None:
        """Make `router` (before it binds) a CURVE server proving the engine's key, whose
        handshakes this guard's ZAP handler decides, refusing everyone if the handler is gone."""
        router.curve_server = True
        router.curve_secretkey = self.keys.own.secret
        router.curve_publickey = self.keys.own.public
        router.zap_domain = self.domain.encode()
        router.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        self._monitor = router.get_monitor_socket(MONITORED_EVENTS)

    @property
    def monitor(self) -> zmq.Socket:
        """The ROUTER's failed handshakes (`MONITORED_EVENTS`), readable when one is waiting; its
        owner closes it with the ROUTER."""
        assert self._monitor is not None, "secure_server makes the monitor"
        return self._monitor

    def take_handshake_failures(self) -> bool:
        """Count (and log, bounded) every failed handshake the ROUTER's monitor has reported so
        far; True if there was one. The engine's loop calls it when `monitor` is readable."""
        num_taken = 0
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            reason = handshake_refusal(event["event"], event["value"])
            self._refused(reason, f"{HANDSHAKE_REASONS[reason]} (reason {reason})")
            num_taken += 1
        return num_taken > 0

    def _refused(self, reason: str, detail: str) -> None:
        with self._lock:
            self.refused_handshakes[reason] += 1
            self.refusal_log.refused(self.domain, detail)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """The ZAP decision (on the authenticator's thread): only listed keys finish the handshake."""
        if client_key in self._identities or is_active(Fault.OPEN_ENGINE_LINKS):
            return True
        self._refused("unlisted_key", f"a CURVE key on no allow-list ({client_key.decode(errors='replace')}, "
                                      f"reason unlisted_key)")
        return False

    def identify(self, frame: zmq.Frame) -> LinkIdentity | None:
        """Who sent `frame` (received with copy=False), from the User-Id its handshake was given;
        None for a key on no allow-list."""
        try:
            user_id = frame.get("User-Id")
        except zmq.ZMQError:
            return None  # no ZAP identity on this frame: not a CURVE connection
        identity = self._identities.get(str(user_id).encode())
        if identity is None and is_active(Fault.OPEN_ENGINE_LINKS):
            return _STRANGER
        return identity

    def allows(self, identity: LinkIdentity | None, msg: PdMsg) -> bool:
        """Whether the engine acts on `msg` from `identity`; counts and logs a refusal."""
        if identity is not None and (is_active(Fault.SKIP_LINK_ROLE_CHECK)
                                     or isinstance(msg, MESSAGES_OF[identity.role])):
            return True
        with self._lock:
            self.num_refused_messages += 1
        logger.error("refused %s from %s: its role may not send it", type(msg).__name__, identity or "an unknown key")
        return False

    def close(self) -> None:
        """Stop the ZAP handler (the ROUTER's owner closes `monitor` with the ROUTER)."""
        self._authenticator.stop()
