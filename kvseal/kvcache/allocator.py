"""Page allocator: hands out whole pages and records who owns each one (I3).

A page is free or owned by exactly one live request (a prefix cache, when added, is a third
state with its own owner record). Every allocation of a page bumps a global generation
counter, so a page's (owner, generation) names one ownership period and a slot written in an
earlier period can never pass for one written in this one. The allocator knows requests only
by id and tenant; it never sees tokens or tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvseal.errors import KvsealError


class OutOfPages(KvsealError):
    """Internal: allocate/append was called without checking can_allocate/can_append."""


@dataclass(frozen=True)
class PageOwner:
    request_id: str
    tenant: str
    generation: int


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._owner: list[PageOwner | None] = [None] * num_pages
        self._pages: dict[str, list[int]] = {}
        self._tenant: dict[str, str] = {}
        self._next_generation = 1

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_owned_pages(self) -> int:
        return sum(len(p) for p in self._pages.values())

    def can_allocate(self, num_pages: int) -> bool:
        return 0 <= num_pages <= len(self._free)

    def allocate(self, request_id: str, tenant: str, num_pages: int) -> list[int]:
        """Give a request that owns nothing yet `num_pages` pages."""
        if request_id in self._pages:
            raise OutOfPages(f"request {request_id} already owns pages; use append")
        self._tenant[request_id] = tenant
        self._pages[request_id] = []
        return self.append(request_id, num_pages)

    def can_append(self, request_id: str, num_pages: int) -> bool:
        return request_id in self._pages and self.can_allocate(num_pages)

    def append(self, request_id: str, num_pages: int) -> list[int]:
        """Add `num_pages` pages to a request that already owns some (or none yet)."""
        if request_id not in self._pages:
            raise OutOfPages(f"request {request_id} is unknown to the allocator; allocate first")
        if not self.can_allocate(num_pages):
            raise OutOfPages(f"{num_pages} pages asked, {len(self._free)} free")
        tenant = self._tenant[request_id]
        new_pages = [self._free.pop() for _ in range(num_pages)]
        for page in new_pages:
            self._owner[page] = PageOwner(request_id, tenant, self._next_generation)
            self._next_generation += 1
        self._pages[request_id].extend(new_pages)
        return new_pages

    def free(self, request_id: str) -> list[int]:
        """Return every page of the request to the free list. Unknown ids free nothing."""
        pages = self._pages.pop(request_id, [])
        self._tenant.pop(request_id, None)
        for page in pages:
            self._owner[page] = None
        self._free.extend(reversed(pages))
        return pages

    def pages_of(self, request_id: str) -> list[int]:
        return list(self._pages.get(request_id, ()))

    def owner_of(self, page: int) -> PageOwner | None:
        return self._owner[page]

    def owner_ids(self) -> set[str]:
        return set(self._pages)

    def owns(self, request_id: str) -> bool:
        return request_id in self._pages

    def check_integrity(self) -> None:
        """free + owned = total, every page exactly one state, owner records consistent."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        owned: set[int] = set()
        for request_id, pages in self._pages.items():
            for page in pages:
                assert page not in owned, f"page {page} has two owners"
                assert page not in free, f"page {page} is both free and owned"
                owner = self._owner[page]
                assert owner is not None and owner.request_id == request_id, f"page {page} owner record disagrees"
                assert owner.tenant == self._tenant[request_id], f"page {page} tenant record disagrees"
                owned.add(page)
        assert len(free) + len(owned) == self.num_pages, "free + owned != total"
        assert all(self._owner[p] is None for p in free), "a free page still names an owner"
