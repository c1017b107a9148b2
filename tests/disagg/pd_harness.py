"""Two real engines (prefill, decode) in this process over loopback TCP, and a hand-driven
frontend: what the PD frontend does, one message at a time, so every step can be broken.

Every link is authenticated as in production (I9): the engines each have their own ZMQ
context (so their own ZAP handler), the test frontend proves the frontend key, and `rogue` (a
broken prefill's links to decode) proves prefill's key, the one decode accepts as a peer."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq
from processes import WAIT_DEADLINE_S, free_port

from kvseal.config import EngineArgs
from kvseal.disagg.config import DEFAULT_FRONTEND_TIMEOUT_S, DEFAULT_KEEPALIVE_INTERVAL_S, NodeConfig
from kvseal.disagg.link_auth import secure_client
from kvseal.disagg.link_keys import EngineLinkKeys, KeyPair
from kvseal.disagg.msgs import (
    PdMsg,
    PrefillDoneMsg,
    PrefillMsg,
    PrefillRefusedMsg,
    ReservedMsg,
    ReserveMsg,
    ReserveRefusedMsg,
    decode,
    encode,
)
from kvseal.disagg.node import EngineNode
from kvseal.disagg.transport import PushPlan
from kvseal.disagg.wire import PeerLink, PeerLinks
from kvseal.engine.engine import LLMEngine
from kvseal.engine_api import RequestEvent
from kvseal.messages.convert import params_to_msg
from kvseal.messages.msgs import OutputsMsg, RequestOutputMsg, RequestRejectedMsg
from kvseal.types import SamplingParams

MAX_ITERATIONS = 2000
_ids = itertools.count()


class Ends:
    """A request's observer for tests that drive the PD frontend by hand: it keeps the request's
    terminal event and lets every output pass."""

    def __init__(self) -> None:
        self.events: list[RequestEvent] = []

    def on_output(self, out: RequestOutputMsg) -> None:
        pass

    def on_terminal(self, event: RequestEvent) -> None:
        self.events.append(event)


@dataclass(frozen=True)
class PdKeys:
    """Throw-away key pairs of a test deployment, and each engine's allow-lists."""

    frontend: KeyPair
    prefill: KeyPair
    decode: KeyPair

    @classmethod
    def ephemeral(cls) -> PdKeys:
        return cls(KeyPair.ephemeral("frontend"), KeyPair.ephemeral("prefill"), KeyPair.ephemeral("decode"))

    def of_prefill(self) -> EngineLinkKeys:
        return EngineLinkKeys(self.prefill, (self.frontend.public_key(),))

    def of_decode(self) -> EngineLinkKeys:
        return EngineLinkKeys(self.decode, (self.frontend.public_key(),), (self.prefill.public_key(),))


class TestFrontend:
    """A DEALER to one engine (proving `own`, expecting `server_key`); collects everything the
    engine sends back."""

    __test__ = False  # a helper, not a test class, in the modules that import it

    def __init__(self, ctx: zmq.Context, address: str, own: KeyPair, server_key: bytes) -> None:
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        secure_client(self.socket, own, server_key)
        self.socket.connect(f"tcp://{address}")
        self.received: list[PdMsg] = []

    def send(self, msg: PdMsg) -> None:
        self.socket.send(encode(msg))

    def collect(self) -> None:
        while self.socket.poll(0):
            self.received.append(decode(self.socket.recv()))


@dataclass
class Handoff:
    """Everything the frontend saw for one request."""

    request_id: str
    reserved: ReservedMsg | None = None
    refused: ReserveRefusedMsg | None = None
    prefill_result: PrefillDoneMsg | PrefillRefusedMsg | None = None
    outputs: list[RequestOutputMsg] = field(default_factory=list)
    rejected: RequestRejectedMsg | None = None

    @property
    def is_terminal(self) -> bool:
        return (self.refused is not None or self.rejected is not None
                or any(o.finished for o in self.outputs))

    @property
    def token_ids(self) -> list[int]:
        return [t for o in self.outputs for t in o.new_token_ids]

    @property
    def final(self) -> RequestOutputMsg:
        return self.outputs[-1]


class PdPair:
    def __init__(self, prefill_args: EngineArgs, decode_args: EngineArgs, reservation_timeout_s: float = 30.0,
                 loaded: Any = None, kv_transport: str = "tcp", transfer_drain_s: float = 5.0,
                 frontend_timeout_s: float = DEFAULT_FRONTEND_TIMEOUT_S,
                 keepalive_interval_s: float = DEFAULT_KEEPALIVE_INTERVAL_S) -> None:
        self.ctx = zmq.Context()  # the test's own sockets; each engine has its own context
        self.keys = keys = PdKeys.ephemeral()
        prefill_args, decode_args = (dataclasses.replace(a, pd_role=True) for a in (prefill_args, decode_args))
        self.prefill = EngineNode(LLMEngine(prefill_args, loaded),
                                  NodeConfig("prefill", f"127.0.0.1:{free_port()}", kv_transport,
                                             frontend_timeout_s=frontend_timeout_s,
                                             keepalive_interval_s=keepalive_interval_s, link_keys=keys.of_prefill()))
        self.decode = EngineNode(LLMEngine(decode_args, loaded),
                                 NodeConfig("decode", f"127.0.0.1:{free_port()}", kv_transport,
                                            reservation_timeout_s=reservation_timeout_s,
                                            transfer_drain_s=transfer_drain_s, frontend_timeout_s=frontend_timeout_s,
                                            link_keys=keys.of_decode()))
        self.to_prefill = TestFrontend(self.ctx, self.prefill.config.listen, keys.frontend, keys.prefill.public)
        self.to_decode = TestFrontend(self.ctx, self.decode.config.listen, keys.frontend, keys.decode.public)
        self.handoffs: dict[str, Handoff] = {}
        self.rogue = PeerLinks(self.ctx, keys.prefill)  # a broken prefill's links to decode, for fault tests

    def plan(self, r: ReservedMsg, src: list[int], written: list[int], kv_address: str | None = None,
             start: int = 0, dest: list[int] | None = None) -> PushPlan:
        """A push into reservation `r` (its transfer id and key) from prefill pages `src`."""
        return PushPlan(r.transfer_id, src, written, r.kv_address if kv_address is None else kv_address,
                        r.pages if dest is None else dest, start, transfer_key=r.transfer_key,
                        decode_key=self.keys.decode.public)

    def peer_link(self) -> PeerLink:
        """A broken prefill's link to decode (it proves prefill's key)."""
        return self.rogue.get(self.decode.config.listen, self.keys.decode.public)

    def close(self) -> None:
        for engine in (self.prefill.engine, self.decode.engine):
            engine.close()  # their grammar workers
        self.rogue.close()
        for s in (self.to_prefill.socket, self.to_decode.socket):
            s.close(linger=0)
        for node in (self.prefill, self.decode):
            node.close()
            node.ctx.term()
        self.ctx.term()

    def pump(self, until: Callable[[], bool], what: str, max_iterations: int = MAX_ITERATIONS) -> None:
        """Run both loops (and route replies) until `until()`; fail after a bounded number of turns
        (turns while a grammar compiles in a worker process do not count, up to WAIT_DEADLINE_S)."""
        num_turns = 0
        deadline_s = time.monotonic() + WAIT_DEADLINE_S
        while num_turns < max_iterations:
            self.prefill.loop.run_once(idle_poll_ms=1)
            self.decode.loop.run_once(idle_poll_ms=1)
            self._route()
            if until():
                return
            if not (self._is_compiling() and time.monotonic() < deadline_s):
                num_turns += 1
        raise AssertionError(f"gave up waiting for {what} after {max_iterations} iterations")

    def _is_compiling(self) -> bool:
        stats = [node.engine.grammar_stats() for node in (self.prefill, self.decode)]
        return any(s.num_running or s.num_queued for s in stats)

    def _route(self) -> None:
        for frontend in (self.to_prefill, self.to_decode):
            frontend.collect()
            for msg in frontend.received:
                self._on(msg)
            frontend.received.clear()

    def _on(self, msg: PdMsg) -> None:
        match msg:
            case ReservedMsg():
                self.handoffs[msg.request_id].reserved = msg
            case ReserveRefusedMsg():
                self.handoffs[msg.request_id].refused = msg
            case PrefillDoneMsg() | PrefillRefusedMsg():
                self.handoffs[msg.request_id].prefill_result = msg
            case OutputsMsg():
                for out in msg.outputs:
                    self.handoffs[out.request_id].outputs.append(out)
            case RequestRejectedMsg():
                self.handoffs[msg.request_id].rejected = msg

    def reserve(self, prompt: list[int], params: SamplingParams, tenant: str = "alice", wait: bool = True) -> Handoff:
        request_id = f"pd-{next(_ids)}"
        handoff = self.handoffs[request_id] = Handoff(request_id)
        self.to_decode.send(ReserveMsg(request_id, tenant, prompt, params_to_msg(params)))
        if wait:
            self.pump(lambda: handoff.reserved is not None or handoff.refused is not None, "the reservation")
        return handoff

    def prefill_msg(self, handoff: Handoff, prompt: list[int], params: SamplingParams,
                    tenant: str = "alice") -> PrefillMsg:
        r = handoff.reserved
        assert r is not None
        return PrefillMsg(handoff.request_id, tenant, prompt, params_to_msg(params), r.transfer_id,
                          self.decode.config.listen, self.keys.decode.public, self.decode.instance_id, r.kv_address,
                          r.transfer_key, r.pages, r.num_cached_tokens)

    def generate(self, prompt: list[int], params: SamplingParams, tenant: str = "alice") -> Handoff:
        handoff = self.reserve(prompt, params, tenant)
        if handoff.reserved is not None:
            self.to_prefill.send(self.prefill_msg(handoff, prompt, params, tenant))
            self.wait(handoff)
        return handoff

    def generate_all(self, prompts: list[list[int]], params: SamplingParams) -> list[Handoff]:
        """Reserve every prompt, then hand them all to prefill at once and wait for every end:
        the handoffs run side by side."""
        handoffs = [self.reserve(p, params) for p in prompts]
        for handoff, prompt in zip(handoffs, prompts):
            self.to_prefill.send(self.prefill_msg(handoff, prompt, params))
        for handoff in handoffs:
            self.wait(handoff)
        return handoffs

    def generate_start(self, prompt: list[int], params: SamplingParams, tenant: str = "alice") -> Handoff:
        """Hand a request off and return once decode reported its first token."""
        handoff = self.reserve(prompt, params, tenant)
        self.to_prefill.send(self.prefill_msg(handoff, prompt, params, tenant))
        self.pump(lambda: bool(handoff.outputs) or handoff.is_terminal, f"the first token of {handoff.request_id}")
        return handoff

    def wait(self, handoff: Handoff) -> None:
        self.pump(lambda: handoff.is_terminal and (handoff.refused is not None or handoff.prefill_result is not None),
                  f"the end of {handoff.request_id}")

    def assert_clean(self) -> None:
        """Both engines' invariants hold and every page is free again."""
        for node in (self.prefill, self.decode):
            node.check_integrity()
            assert node.engine.kv.num_used_pages == 0, f"{node.config.role} still holds pages"
            assert not node.steps.held()


class SharedPair:
    """A pair lent to one test after another, built by `make(key)` (its engines, workers and
    ranks started once, not per test) and put back as a new one would be found: `reset` (e.g.
    faults off on a rank), then every page free and nothing held (`PdPair.assert_clean`). A pair
    that fails this is closed, and the next test gets a new one; lent with another key, the pair
    is closed and another built."""

    def __init__(self, make: Callable[[Any], PdPair], reset: Callable[[PdPair], None] | None = None) -> None:
        self._make, self._reset = make, reset
        self.pair: PdPair | None = None
        self._key: Any = None

    def lend(self, key: Any = None) -> Iterator[PdPair]:
        if self.pair is not None and key != self._key:
            self.close()
        if self.pair is None:
            self.pair, self._key = self._make(key), key
        pair = self.pair
        yield pair
        try:
            if self._reset is not None:
                self._reset(pair)
            pair.assert_clean()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self.pair is not None:
            self.pair.close()
            self.pair = None
