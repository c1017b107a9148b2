"""Run-preferring page allocation for decode's reservations: a reservation takes the lowest run
of consecutive free page ids that fits (so a KV transfer moves a few large blocks), falls back
to any free pages when no run fits, and keeps every allocator invariant either way."""

from __future__ import annotations

from pathlib import Path

from kvseal import SamplingParams
from kvseal.config import EngineArgs
from kvseal.disagg.reservations import Reservation, ReservationTable
from kvseal.disagg.tcp import TcpReceiver
from kvseal.engine.engine import LLMEngine
from kvseal.kvcache.allocator import PageAllocator
from kvseal.kvcache.prefix_cache import namespace_of


def fragmented(num_pages: int, held: list[int]) -> PageAllocator:
    """An allocator whose pages `held` are owned (one request each, "h<page>"), the rest free."""
    allocator = PageAllocator(num_pages)
    for page in range(num_pages):
        allocator.allocate(f"p{page}", "filler", 1)
    for page in range(num_pages):
        if page not in held:
            allocator.free(f"p{page}")
    return allocator


def test_consecutive_takes_the_lowest_run_that_fits() -> None:
    allocator = fragmented(16, held=[1, 4, 5, 9])  # free runs: 0 | 2-3 | 6-8 | 10-15
    assert allocator.allocate("a", "alice", 3, consecutive=True) == [6, 7, 8]  # 2-3 is too short
    assert allocator.allocate("b", "bob", 2, consecutive=True) == [2, 3]
    assert allocator.allocate("c", "carol", 4, consecutive=True) == [10, 11, 12, 13]
    allocator.check_integrity()
    owners = {page: allocator.owner_of(page) for page in range(16)}
    assert all(owners[p].request_id == "a" and owners[p].tenant == "alice" for p in (6, 7, 8))  # type: ignore[union-attr]
    generations = [o.generation for o in owners.values() if o is not None]
    assert len(set(generations)) == len(generations)  # every hand-out its own ownership period
    assert sorted(allocator.own_pages_of("c")) == allocator.own_pages_of("c")


def test_consecutive_falls_back_to_any_free_pages_and_appends_like_any_other() -> None:
    allocator = fragmented(8, held=[1, 3, 5, 7])  # free: 0, 2, 4, 6: no run of 2
    pages = allocator.allocate("a", "alice", 3, consecutive=True)
    assert len(set(pages)) == 3 and set(pages) <= {0, 2, 4, 6}
    allocator.check_integrity()
    allocator.free("p1")
    allocator.free("p3")
    assert allocator.num_unused_pages == 3
    assert len(allocator.append("a", 2, consecutive=True)) == 2
    allocator.check_integrity()
    freed = allocator.free("a")
    assert len(freed) == 5 and all(allocator.owner_of(p) is None for p in freed)
    allocator.check_integrity()


def test_a_reservation_on_a_fragmented_pool_gets_one_run(llama_dir: Path) -> None:
    """Decode's reservations ask for consecutive pages; pages a running request holds are
    never among them, and the table drains clean."""
    engine = LLMEngine(EngineArgs(model=str(llama_dir), kv_cache_tokens=128, max_model_len=64, page_size=4,
                                  dtype="float32"))
    kv = engine.kv
    for page in range(kv.allocator.num_pages):  # fragment the pool: every third page held
        kv.reserve(f"filler{page}", "filler", 4)
        assert kv.allocator.own_pages_of(f"filler{page}") == [page]
    for page in range(kv.allocator.num_pages):
        if page % 3:
            kv.free(f"filler{page}")
    table = ReservationTable(kv, TcpReceiver(kv.pool, engine.model_config.num_layers, "test"), 60.0)
    held = set(range(0, kv.allocator.num_pages, 3))
    table.add(Reservation("r1", "alice", list(range(5)), SamplingParams(max_tokens=1, temperature=0), b"frontend",
                          namespace_of("alice")))  # 5 + 1 tokens: 2 pages of 4
    (placed,) = table.place_waiting()
    assert list(placed.pages) == [1, 2]
    table.add(Reservation("r2", "bob", list(range(9)), SamplingParams(max_tokens=1, temperature=0), b"frontend",
                          namespace_of("bob")))  # 3 pages: no free run of 3, any free pages
    (placed,) = table.place_waiting()
    assert len(placed.pages) == 3 and not set(placed.pages) & held and not set(placed.pages) & {1, 2}
    engine.check_integrity(table.request_ids() | {f"filler{page}" for page in held})
    for reservation in [table.by_request("r1"), table.by_request("r2")]:
        assert reservation is not None and table.release(reservation, "aborted")
    for page in held:
        kv.free(f"filler{page}")
    assert kv.allocator.num_unused_pages == kv.allocator.num_pages
    kv.allocator.check_integrity()
