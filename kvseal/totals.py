"""A running total over sources that each report a cumulative count (engines, the audit log)."""

from __future__ import annotations


class CumulativeTotal:
    """A total that never goes backwards, over sources that each report a cumulative count.

    A source's count grows while it lives; a source that restarts (a count below its last one)
    starts again from 0, so all of its new count is new. A source that goes away keeps what it
    added. Sources are named by the caller (an engine instance id; one per start)."""

    def __init__(self) -> None:
        self.total = 0
        self._last: dict[str, int] = {}

    def observe(self, source: str, count: int) -> int:
        """Take `source`'s latest cumulative count; returns how much the total grew (>= 0)."""
        last = self._last.get(source, 0)
        grown = count - last if count >= last else count
        self._last[source] = count
        self.total += grown
        return grown
