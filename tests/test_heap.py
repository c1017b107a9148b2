"""`freeze_startup_heap`: what exists at start-up leaves the collector's reach, and the
collector still reclaims cycles made afterwards."""

from __future__ import annotations

import gc
import weakref

from kvseal.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def test_freeze_moves_the_heap_out_of_collection_and_later_cycles_are_still_reclaimed() -> None:
    before = _Node()
    before.other = before  # a cycle alive at "start-up"
    try:
        freeze_startup_heap("test")
        assert gc.get_freeze_count() > 0
        assert all(o is not before for o in gc.get_objects())  # frozen objects are not walked
        later = _Node()
        later.other = later
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None, "a cycle made after the freeze is reclaimed"
    finally:
        gc.unfreeze()
    assert any(o is before for o in gc.get_objects())
