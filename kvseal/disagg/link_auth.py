"""Who may talk to an engine, and what each may say (I9).

Two gates, both on the engine's one ROUTER:

1. **Authentication, at the handshake.** The ROUTER is a CURVE server (`secure_server`) whose
   ZAP handler (pyzmq's `ThreadAuthenticator`, one per engine) lets a client finish the
   handshake only if its public key is on one of the engine's allow-lists. A client with any
   other key, or with none (plain ZMQ), never completes it: the engine reads no byte of it, so
   it answers nothing, not even a hello. `ZAP_ENFORCE_DOMAIN` makes a missing ZAP handler
   refuse everyone rather than accept everyone (libzmq's default).
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
from dataclasses import dataclass
from typing import Literal

import zmq
from zmq.auth.thread import ThreadAuthenticator

from kvseal._testing.faults import Fault, is_active
from kvseal.disagg.link_keys import EngineLinkKeys, KeyPair
from kvseal.disagg.msgs import (
    CommitMsg,
    HelloMsg,
    IntegrityCheckMsg,
    KVBlockMsg,
    PdMsg,
    PrefillMsg,
    ReserveMsg,
    TransferAbortMsg,
)
from kvseal.errors import ConfigError
from kvseal.messages.msgs import AbortMsg, ShutdownMsg

logger = logging.getLogger("kvseal.disagg")

LinkRole = Literal["frontend", "peer"]

# What each role may send to an engine; everything else from it is refused.
MESSAGES_OF: dict[LinkRole, tuple[type, ...]] = {
    "frontend": (HelloMsg, IntegrityCheckMsg, ShutdownMsg, ReserveMsg, PrefillMsg, AbortMsg),
    "peer": (KVBlockMsg, CommitMsg, TransferAbortMsg),
}


@dataclass(frozen=True)
class LinkIdentity:
    role: LinkRole
    name: str

    def __str__(self) -> str:
        return f"{self.role}:{self.name}"


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
        self.num_refused_handshakes = 0
        self.num_refused_messages = 0
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

    def callback(self, domain: str, client_key: bytes) -> bool:
        """The ZAP decision (on the authenticator's thread): only listed keys finish the handshake."""
        if client_key in self._identities or is_active(Fault.OPEN_ENGINE_LINKS):
            return True
        with self._lock:
            self.num_refused_handshakes += 1
        logger.warning("refused a CURVE handshake on %s from a key on no allow-list (%s)", domain,
                       client_key.decode(errors="replace"))
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
        self._authenticator.stop()
