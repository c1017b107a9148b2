"""What a role is: a few step functions the shared engine loop calls (no `if role ==` there).

`handle` takes one received message (from the engine's `RouterLink`), `on_outputs` the outputs
of one engine step, `tick` runs once per loop iteration (deadlines), `poll_ms` says how long an
idle loop may wait, `held` names requests that own pages without running. The loop itself is
the colocated engine's (`kvseal.engine.loop.EngineLoop`).
"""

from __future__ import annotations

import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import zmq

from kvseal.disagg.msgs import AbortUnsentMsg, PdMsg, Role, encode
from kvseal.engine.engine import LLMEngine
from kvseal.engine.loop import LoopSteps
from kvseal.messages.msgs import AbortMsg, RequestOutputMsg
from kvseal.types import RequestOutput

FRONTEND_GONE = "frontend_gone"  # the abort reason of a request whose frontend is gone (`frontend_watch.py`)


@dataclass
class HandoffCounters:
    """Per-engine handoff counters, reported in `PdStatsMsg` (the frontend exports them)."""

    num_transfers: int = 0
    num_transfer_bytes: int = 0
    transfer_s_total: float = 0.0
    failures: Counter[str] = field(default_factory=Counter)
    num_reservations_expired: int = 0


class Replies:
    """Sends to frontends through the engine's ROUTER, by the identity they connected with, and
    notes the identities whose connection is closed (`frontend_watch.py`: their work ends)."""

    def __init__(self, router: zmq.Socket) -> None:
        self._router = router
        self._unreachable: set[bytes] = set()

    @property
    def has_unreachable(self) -> bool:
        return bool(self._unreachable)

    def send(self, frontend: bytes, msg: PdMsg) -> None:
        try:
            self._router.send_multipart([frontend, encode(msg)], zmq.NOBLOCK)
        except zmq.Again:
            pass  # that frontend is not reading: it fails the request on its side
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._unreachable.add(frontend)  # ZMQ_ROUTER_MANDATORY: no connection has this identity any more

    def take_unreachable(self) -> set[bytes]:
        """The identities a send found closed since the last call."""
        unreachable, self._unreachable = self._unreachable, set()
        return unreachable


class RoleSteps(LoopSteps, Protocol):
    role: Role
    counters: HandoffCounters

    def handle(self, sender: bytes, msg: PdMsg, payload: list[memoryview]) -> bool:
        """Act on one message; False if this role does not take that message."""
        ...

    def held(self) -> set[str]: ...

    def wait_sockets(self) -> list[socket.socket]:
        """Sockets besides the ROUTER whose data should wake the loop (a transport's own)."""
        ...

    def num_reservations(self) -> int: ...

    def abort_all(self, reason: str, error_code: str | None = None) -> None:
        """End everything the engine holds, each end reported with `reason` (and `error_code`:
        `ENGINE_UNAVAILABLE` when the engine itself was lost, so the client gets a 503)."""
        ...

    def abort_frontend(self, frontend: bytes, reason: str) -> int:
        """End everything `frontend` (a ROUTER identity) asked for; how many requests that ended."""
        ...


def aborted_output(request_id: str, tenant: str, num_prompt_tokens: int, num_pages: int, error: str,
                   error_code: str | None) -> RequestOutputMsg:
    """The terminal report of a request that ends before it ran (never a success)."""
    return RequestOutputMsg(request_id=request_id, tenant=tenant, new_token_ids=[], new_text="", finished=True,
                            finish_reason="abort", stop_reason=None, num_prompt_tokens=num_prompt_tokens,
                            num_output_tokens=0, num_pages_reserved=num_pages, error=error, error_code=error_code)


def abort_owned(engine: LLMEngine, msg: AbortMsg | AbortUnsentMsg) -> list[RequestOutput]:
    """End the engine's request `msg` names, only if `msg.tenant` owns it; its final output (or none)."""
    request = engine.find(msg.request_id)
    if request is None or request.tenant != msg.tenant:
        return []  # already finished (its final output is on its way) or not this tenant's
    out = engine.abort(msg.request_id, msg.reason)
    return [out] if out is not None else []


def abort_every(engine: LLMEngine, reason: str, error_code: str | None = None) -> list[RequestOutput]:
    """End every queued and running request of the engine; their final outputs."""
    return [o for o in (engine.abort(rid, reason, error_code) for rid in engine.unfinished_ids()) if o is not None]
