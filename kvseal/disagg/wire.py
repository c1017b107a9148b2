"""The ZMQ wiring of a networked engine: its ROUTER at `--listen`, and DEALER links to peers.

Every engine binds exactly one ROUTER, on the address it was given; frontends and peer
engines connect DEALERs to it. Frames are `[header, payload...]`, the header a `PdMsg`, then
zero or more payload frames. Links use ZMQ_IMMEDIATE: a message is queued only on a live connection, so nothing
sent to a dead or restarted engine is delivered later to a stranger; `send` waits a bounded
time for the connection and raises `TransportError` instead. Every link is a CURVE client
(I9): it proves this engine's own key pair and talks only to an engine that proves the public
key it was given, so a connection counts as live only once both sides' handshake succeeded.
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq

from kvseal._testing.faults import Fault, is_active
from kvseal.disagg.link_auth import secure_client
from kvseal.disagg.link_keys import KeyPair
from kvseal.disagg.msgs import PdMsg, encode
from kvseal.disagg.transport import TransportError

CONNECT_TIMEOUT_MS = 3_000
LINGER_MS = 1_000


def tcp_endpoint(address: str) -> str:
    """"HOST:PORT" -> "tcp://HOST:PORT" (ZMQ's form); already-prefixed endpoints pass through."""
    return address if "://" in address else f"tcp://{address}"


class PeerLink:
    """One DEALER to one engine, in send order: KV frames, then the commit or abort."""

    def __init__(self, ctx: zmq.Context, address: str, own: KeyPair, server_key: bytes) -> None:
        self.address = address
        self.socket = ctx.socket(zmq.DEALER)
        if is_active(Fault.BREAK_PEER_LINK_SETUP):
            raise RuntimeError(f"test fault: the link to {address} broke during setup, its socket left open")
        try:
            self.socket.setsockopt(zmq.IMMEDIATE, 1)
            self.socket.setsockopt(zmq.LINGER, LINGER_MS)
            secure_client(self.socket, own, server_key)
            self.socket.connect(tcp_endpoint(address))
        except zmq.ZMQError as exc:  # a malformed key or address: no link, and no socket left open
            self.socket.close(linger=0)
            raise TransportError(f"cannot link to the engine at {address}: {exc}") from exc
        self._is_failing = False  # the last send found no connection: do not wait again until one is back

    def send(self, msg: PdMsg, payload: Sequence[bytes | memoryview] = (),
             timeout_ms: int = CONNECT_TIMEOUT_MS) -> zmq.MessageTracker | None:
        """Queue `msg` (and its payload frames) on the live connection; `TransportError` if
        there is none within `timeout_ms` (refused, reset, or nobody listening). After one
        failure the link does not wait again until a connection is back. Payload frames are sent
        without a copy: ZMQ reads them until the returned tracker is done, so the caller must not
        overwrite them before then (ZMQ keeps the buffer objects alive itself)."""
        if not self.socket.poll(0 if self._is_failing else timeout_ms, zmq.POLLOUT):
            self._is_failing = True
            raise TransportError(f"cannot reach the engine at {self.address}: no authenticated connection within "
                                 f"{timeout_ms} ms (refused, reset, not listening, or the CURVE handshake failed: "
                                 f"is this engine's public key in its --peer-keys?)")
        frames: list[bytes | memoryview] = [encode(msg), *payload]
        try:
            tracker = self.socket.send_multipart(frames, zmq.NOBLOCK, copy=not payload, track=bool(payload))
        except zmq.Again as exc:
            self._is_failing = True
            raise TransportError(f"the connection to {self.address} is gone or full") from exc
        self._is_failing = False
        return tracker

    def send_if_connected(self, msg: PdMsg) -> bool:
        """Queue `msg` if a connection is up now; never waits, and leaves `send`'s failure state
        alone (a message that may be skipped, a keepalive, must not make the commit skip its wait)."""
        if not self.socket.poll(0, zmq.POLLOUT):
            return False
        try:
            self.socket.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        self.socket.close(linger=0)


class PeerLinks:
    """Links to peer engines by address and the key each must prove, created on first use; each
    proves `own` (this engine's key pair)."""

    def __init__(self, ctx: zmq.Context, own: KeyPair) -> None:
        self._ctx = ctx
        self._own = own
        self._links: dict[tuple[str, bytes], PeerLink] = {}

    def get(self, address: str, server_key: bytes) -> PeerLink:
        if (address, server_key) not in self._links:
            self._links[(address, server_key)] = PeerLink(self._ctx, address, self._own, server_key)
        return self._links[(address, server_key)]

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()
