"""Which frontends an engine still serves, so that the work of one that is gone ends (I6).

An engine acts on a frontend's messages only; nothing else ends that frontend's requests, prefill
jobs and reservations. Were the frontend to die, they would run on (decode generating to
`max_tokens` for nobody, its pages held from every other tenant), and a restarted frontend
could not abort them: it does not know their ids. So the engine watches its frontends itself.

A frontend's work is keyed by its ROUTER identity: the one connection its messages came on.
kvseal's frontend sets no identity of its own, so libzmq gives every connection a new one, never
reused: a frontend that reconnects is a new identity, and what it had on the old one can no
longer reach it (the frontend failed those requests itself when its link dropped,
`frontend.PdClient._engine_down`). An identity is gone when

- its connection closed: the ROUTER (`ZMQ_ROUTER_MANDATORY`) refuses a send to it (`Replies`).
  A busy engine sends every frontend its stats after each step, and every engine does at least
  every `PROBE_S`, so a frontend whose process died is found within about a second; or
- it said hello (kvseal's frontend does every 0.5 s) and then nothing for `timeout_s`: a
  connection left open with nobody behind it (its host gone without closing it, a stopped process).

The ROUTER's socket monitor also reports closed connections, but by file descriptor, which a new
connection may take before the event is read: a refused send names the identity itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable

PROBE_S = 1.0  # an engine sends stats to every frontend at least this often


class FrontendWatch:
    """When each frontend that said hello was last heard from, and when to probe them all."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._last_heard_s: dict[bytes, float] = {}
        self._names: dict[bytes, str] = {}
        self._next_probe_s = clock() + PROBE_S

    @property
    def frontends(self) -> list[bytes]:
        """The identities watched: those that said hello and are not gone."""
        return list(self._last_heard_s)

    def hello(self, frontend: bytes, name: str) -> None:
        """`frontend` says hello, promising to say it again every half second; `name` is for the log."""
        self._names[frontend] = name
        self._last_heard_s[frontend] = self.clock()

    def heard(self, frontend: bytes) -> None:
        """Any message is a sign of life (of a watched frontend; others promised nothing)."""
        if frontend in self._last_heard_s:
            self._last_heard_s[frontend] = self.clock()

    def is_probe_due(self) -> bool:
        return self.clock() >= self._next_probe_s

    def probed(self) -> list[bytes]:
        """The probe was sent; the frontends silent for longer than `timeout_s`, which are gone."""
        now_s = self.clock()
        self._next_probe_s = now_s + PROBE_S
        return [f for f, heard_s in self._last_heard_s.items() if now_s - heard_s > self.timeout_s]

    def forget(self, frontend: bytes) -> str | None:
        """Stop watching a gone frontend; its name, or None if it was not watched (no hello, or ended already)."""
        self._last_heard_s.pop(frontend, None)
        return self._names.pop(frontend, None)
