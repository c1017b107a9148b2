"""The loop every engine process runs, colocated or PD role: receive, tick, step, report.

One iteration: wait for messages (not at all while requests are unfinished) and hand every
waiting one to its handler (`LoopLink.receive`), let the engine's kind run its deadlines and
take in what finished off the loop (`LoopSteps.tick`: compiled grammars, landed KV), run one
engine step if anything is unfinished and give its outputs to the kind (`on_outputs`), and
report stats when something changed. What differs between kinds is in their links and steps
(`kvseal.engine.colocated`; `kvseal.disagg.router_link` with `disagg.prefill`/`disagg.decode`),
never in an `if role ==` here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvseal.structured.compiler import GrammarPoolStats
from kvseal.types import RequestOutput

if TYPE_CHECKING:
    from kvseal.engine.engine import LLMEngine


class LoopSteps(Protocol):
    """What one kind of engine does besides receiving messages."""

    def tick(self) -> bool:
        """Deadlines, retries, work finished off the loop; True if anything changed."""
        ...

    def on_outputs(self, outputs: list[RequestOutput]) -> None:
        """The outputs of one engine step (and of aborts), in step order."""
        ...

    def poll_ms(self, idle_poll_ms: int) -> int:
        """How long a loop with nothing unfinished in the engine may wait for a message."""
        ...


class LoopLink(Protocol):
    """Where an engine's messages come from and where its stats go."""

    @property
    def is_stopped(self) -> bool:
        """True once a shutdown (or the parent's exit) ended the loop."""
        ...

    def wait(self, timeout_ms: int) -> bool:
        """Wait up to `timeout_ms` for messages; True if some are waiting."""
        ...

    def receive(self) -> bool:
        """Hand every waiting message to its handler; True if anything changed."""
        ...

    def report_stats(self) -> None: ...


class EngineLoop:
    def __init__(self, engine: LLMEngine, link: LoopLink, steps: LoopSteps, idle_poll_ms: int) -> None:
        self.engine = engine
        self.link = link
        self.steps = steps
        self.idle_poll_ms = idle_poll_ms
        self._grammar_stats_sent = GrammarPoolStats()

    @property
    def is_stopped(self) -> bool:
        return self.link.is_stopped

    def run(self) -> None:
        while self.run_once():
            pass

    def run_once(self, idle_poll_ms: int | None = None) -> bool:
        """One iteration. Returns False once the loop has stopped."""
        idle_ms = self.idle_poll_ms if idle_poll_ms is None else idle_poll_ms
        timeout_ms = 0 if self.engine.has_unfinished() else self.steps.poll_ms(idle_ms)
        changed = self.link.receive() if self.link.wait(timeout_ms) else False
        if self.link.is_stopped:
            return False
        changed = self.steps.tick() or changed
        if self.engine.has_unfinished():
            self.steps.on_outputs(self.engine.step())
            changed = True
        # the grammar pool also changes on its own threads (a worker ready, a compile stopped)
        if changed or self.engine.grammar_stats() != self._grammar_stats_sent:
            self._grammar_stats_sent = self.engine.grammar_stats()
            self.link.report_stats()
        return True
