"""A rogue client of an engine's port (I9 tests): a DEALER with no key at all (plain ZMQ), a
valid key pair the engine was never told about, or a stolen key the engine accepts only as a
peer engine. It watches its own handshake and keeps whatever the engine sends back."""

from __future__ import annotations

from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvseal.disagg.link_auth import secure_client
from kvseal.disagg.link_keys import KeyPair
from kvseal.disagg.msgs import PdMsg, decode, encode

HANDSHAKE_EVENTS = {zmq.EVENT_HANDSHAKE_SUCCEEDED: "succeeded", zmq.EVENT_HANDSHAKE_FAILED_AUTH: "refused_key",
                    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "failed_protocol",
                    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "failed"}
MAX_TURNS = 4000


class Rogue:
    def __init__(self, address: str, own: KeyPair | None, server_key: bytes | None,
                 handshake_ivl_ms: int | None = None) -> None:
        """`own` None: plain ZMQ, no CURVE at all; else a CURVE client proving `own` to a server
        that proves `server_key` (public keys are public: a rogue may know the engine's).
        handshake_ivl_ms: give up a handshake the server never answers after that long (libzmq's
        default: 30 s)."""
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if handshake_ivl_ms is not None:
            self.socket.setsockopt(zmq.HANDSHAKE_IVL, handshake_ivl_ms)
        if own is not None:
            assert server_key is not None
            secure_client(self.socket, own, server_key)
        self.monitor = self.socket.get_monitor_socket(sum(HANDSHAKE_EVENTS))
        self.socket.connect(f"tcp://{address}")
        self.received: list[PdMsg] = []
        self.num_unsent = 0

    def handshake(self, turn: Callable[[], None] = lambda: None) -> str:
        """How the handshake ended ("succeeded", "refused_key", "failed_protocol", "failed"),
        running `turn` (the engines' loops, in process) while waiting; bounded."""
        for _ in range(MAX_TURNS):
            turn()
            if self.monitor.poll(10):
                event = recv_monitor_message(self.monitor)["event"]
                if event in HANDSHAKE_EVENTS:
                    return HANDSHAKE_EVENTS[event]
        raise AssertionError("the rogue's handshake neither succeeded nor failed")

    def send(self, *msgs: PdMsg) -> None:
        """Queued on the connection (before its handshake ended, they wait for it); a connection
        whose handshake failed never delivers them, and once it is gone nothing can be queued."""
        for msg in msgs:
            try:
                self.socket.send(encode(msg), zmq.NOBLOCK)
            except zmq.Again:
                self.num_unsent += 1

    def collect(self, wait_ms: int = 0) -> list[PdMsg]:
        """Everything the engine sent so far (waiting up to `wait_ms` for a first message)."""
        while self.socket.poll(wait_ms):
            self.received.append(decode(self.socket.recv()))
            wait_ms = 0
        return self.received

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)
        self.ctx.term()
