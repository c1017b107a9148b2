"""Page allocator: hands out whole pages and records who holds each one (I3).

A page is in exactly one of three states:

- free: on the free list, no owner;
- owned: by exactly one live request, which writes it (a private page);
- cached: held by the prefix cache under one namespace and one key (`prefix_cache.py`),
  written completely before it was published, read-only from then on. Any number of
  requests of that namespace may read it; it counts its readers, and a cached page no one
  reads is evictable, least recently used first, when an allocation needs room.

free + owned + cached = total, always. A request's page table is its shared (cached) pages
followed by its own pages, in position order: the reuse boundary is page-aligned, and every
page a request writes is its own.

Every hand-out of a page bumps a global generation counter, so a page's (owner, generation)
names one ownership period and a slot written in an earlier period can never pass for one
written in this one; a published page keeps the generation it was written under. The
allocator knows requests only by id, tenant and namespace; it never sees tokens or tensors.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvseal.errors import KvsealError
from kvseal.kvcache.prefix_cache import PageKey


class OutOfPages(KvsealError):
    """Internal: allocate/append was called without checking can_allocate/can_append."""


@dataclass(frozen=True)
class PageOwner:
    request_id: str
    tenant: str
    generation: int


@dataclass
class CachedPage:
    """A page held by the prefix cache: read-only, `num_readers` requests name it. `tenant` and
    `cache_epoch` are those of the request that published it (`KVCacheManager.forget_tenant`)."""

    namespace: str
    key: PageKey
    generation: int
    num_readers: int
    tenant: str = ""
    cache_epoch: int = 0


def lowest_free_run(is_free: np.ndarray, num_pages: int) -> int | None:
    """The lowest index that starts `num_pages` consecutive True entries of `is_free` (a bool
    mask over page ids), or None when no run is that long. Shared by the pool's allocator and
    the NIXL arena, which both prefer one run for a KV transfer."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], is_free.view(np.int8), [0]))))
    starts, ends = edges[0::2], edges[1::2]
    fits = np.flatnonzero(ends - starts >= num_pages)
    return int(starts[fits[0]]) if len(fits) else None


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._owner: list[PageOwner | None] = [None] * num_pages
        self._pages: dict[str, list[int]] = {}  # own pages, in position order after the shared ones
        self._shared: dict[str, list[int]] = {}  # cached pages the request reads, in position order
        self._tenant: dict[str, str] = {}
        self._namespace: dict[str, str] = {}
        self._cached: dict[int, CachedPage] = {}
        self._index: dict[PageKey, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, no reader; least recent first
        self._next_generation = 1

    @property
    def num_free_pages(self) -> int:
        """Pages an allocation can get: free ones, then evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_unused_pages(self) -> int:
        """Pages on the free list (never cached, or evicted)."""
        return len(self._free)

    @property
    def num_owned_pages(self) -> int:
        return sum(len(p) for p in self._pages.values())

    @property
    def num_cached_pages(self) -> int:
        return len(self._cached)

    def can_allocate(self, num_pages: int) -> bool:
        """True if `num_pages` pages can be had, evicting unread cached pages where needed."""
        return 0 <= num_pages <= self.num_free_pages

    def allocate(self, request_id: str, tenant: str, num_pages: int, namespace: str = "",
                 consecutive: bool = False) -> list[int]:
        """Give a request that holds nothing yet `num_pages` pages (evict first if the free list is short)."""
        self._open(request_id, tenant, namespace)
        return self.append(request_id, num_pages, consecutive)

    def _open(self, request_id: str, tenant: str, namespace: str) -> None:
        if request_id in self._pages:
            raise OutOfPages(f"request {request_id} already holds pages; use append")
        self._tenant[request_id] = tenant
        self._namespace[request_id] = namespace
        self._pages[request_id] = []
        self._shared[request_id] = []

    def can_append(self, request_id: str, num_pages: int) -> bool:
        return request_id in self._pages and self.can_allocate(num_pages)

    def append(self, request_id: str, num_pages: int, consecutive: bool = False) -> list[int]:
        """Add `num_pages` pages from the free list to a request that already holds some (or none
        yet). The free list must hold them: `evict` cached pages first when it does not.
        `consecutive`: the lowest run of consecutive free page ids that fits, when there is
        one (a KV transfer then moves few large blocks); otherwise, as always, any free pages."""
        if request_id not in self._pages:
            raise OutOfPages(f"request {request_id} is unknown to the allocator; allocate first")
        if not 0 <= num_pages <= len(self._free):
            raise OutOfPages(f"{num_pages} pages asked, {len(self._free)} free (evict cached pages first)")
        tenant = self._tenant[request_id]
        first = self._lowest_free_run(num_pages) if consecutive and num_pages > 1 else None
        if first is None:
            new_pages = [self._free.pop() for _ in range(num_pages)]
        else:
            new_pages = list(range(first, first + num_pages))
            self._free = [page for page in self._free if not first <= page < first + num_pages]
        for page in new_pages:
            self._owner[page] = PageOwner(request_id, tenant, self._next_generation)
            self._next_generation += 1
        self._pages[request_id].extend(new_pages)
        return new_pages

    def _lowest_free_run(self, num_pages: int) -> int | None:
        """The lowest page id that starts `num_pages` consecutive free pages, or None."""
        is_free = np.zeros(self.num_pages, dtype=bool)
        is_free[self._free] = True
        return lowest_free_run(is_free, num_pages)

    def free(self, request_id: str) -> list[int]:
        """Return every own page of the request to the free list and stop its reads of cached
        pages (a cached page left without readers becomes evictable, most recent last).
        Returns the own pages freed. Unknown ids free nothing."""
        pages = self._pages.pop(request_id, [])
        for page in reversed(self._shared.pop(request_id, [])):  # a prefix's tail is evicted before its head
            self._release(page)
        self._tenant.pop(request_id, None)
        self._namespace.pop(request_id, None)
        for page in pages:
            self._owner[page] = None
        self._free.extend(reversed(pages))
        return pages

    def _release(self, page: int) -> None:
        cached = self._cached[page]
        cached.num_readers -= 1
        if cached.num_readers == 0:
            self._evictable[page] = None

    # --- the prefix cache ------------------------------------------------------------------

    def lookup(self, key: PageKey) -> int | None:
        """The cached page published under `key`, if any."""
        return self._index.get(key)

    def share(self, request_id: str, tenant: str, namespace: str, pages: list[int]) -> None:
        """A request that holds nothing yet starts by reading the cached `pages` (its first
        positions, in order). The caller looked them up under keys of the request's namespace."""
        self._open(request_id, tenant, namespace)
        for page in pages:
            cached = self._cached[page]
            cached.num_readers += 1
            self._evictable.pop(page, None)
        self._shared[request_id] = list(pages)

    def publish(self, request_id: str, key: PageKey, cache_epoch: int = 0) -> int | None:
        """Hand the request's first own page to the prefix cache under `key`, in the request's
        namespace (`cache_epoch`: the request's, `Request.cache_epoch`); the request keeps
        reading it. Returns the page, or None if `key` is already cached (the page then stays
        the request's own). The caller has verified that the page is written completely, in
        every layer."""
        pages = self._pages.get(request_id)
        if not pages or key in self._index:
            return None
        page = pages.pop(0)
        owner = self._owner[page]
        assert owner is not None and owner.request_id == request_id, f"page {page} owner record disagrees"
        self._owner[page] = None
        self._cached[page] = CachedPage(self._namespace[request_id], key, owner.generation, num_readers=1,
                                        tenant=self._tenant[request_id], cache_epoch=cache_epoch)
        self._index[key] = page
        self._shared[request_id].append(page)
        return page

    def evict(self, num_pages: int) -> list[int]:
        """Move the `num_pages` least recently used cached pages no one reads to the free list
        (the caller scrubs them, I7). Returns them."""
        evicted = []
        for _ in range(max(0, min(num_pages, len(self._evictable)))):
            page, _ = self._evictable.popitem(last=False)
            del self._index[self._cached.pop(page).key]
            evicted.append(page)
        self._free.extend(reversed(evicted))
        return evicted

    def evict_unread(self, pages: list[int]) -> list[int]:
        """Move those of `pages` that are cached and read by no one to the free list, whatever
        their age (the caller scrubs them, I7); pages read, own or free are left as they are.
        Returns the pages moved."""
        evicted = [p for p in dict.fromkeys(pages) if p in self._evictable]
        for page in evicted:
            del self._evictable[page]
            del self._index[self._cached.pop(page).key]
        self._free.extend(reversed(evicted))
        return evicted

    # --- queries ---------------------------------------------------------------------------

    def pages_of(self, request_id: str) -> list[int]:
        """The request's page table: shared pages, then own pages, in position order."""
        return [*self._shared.get(request_id, ()), *self._pages.get(request_id, ())]

    def own_pages_of(self, request_id: str) -> list[int]:
        return list(self._pages.get(request_id, ()))

    def num_shared_pages_of(self, request_id: str) -> int:
        return len(self._shared.get(request_id, ()))

    def namespace_of(self, request_id: str) -> str | None:
        return self._namespace.get(request_id)

    def owner_of(self, page: int) -> PageOwner | None:
        """The request that owns (writes) the page; None for a free or a cached page."""
        return self._owner[page]

    def cached_page(self, page: int) -> CachedPage | None:
        return self._cached.get(page)

    def cached_pages_of(self, tenant: str) -> list[int]:
        """Every cached page a request of `tenant` published (any namespace, any epoch)."""
        return [page for page, cached in self._cached.items() if cached.tenant == tenant]

    def shared_pages_of(self, request_id: str) -> list[int]:
        """The cached pages the request reads, in position order."""
        return list(self._shared.get(request_id, ()))

    def cached_namespaces(self) -> dict[int, str]:
        return {page: cached.namespace for page, cached in self._cached.items()}

    def owner_ids(self) -> set[str]:
        return set(self._pages)

    def owns(self, request_id: str) -> bool:
        """True while the request holds pages (own or shared)."""
        return request_id in self._pages

    def check_integrity(self) -> None:
        """free + owned + cached = total, every page exactly one state, owner records, reader
        counts and namespaces consistent."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        owned = self._check_owned(free)
        cached = set(self._cached)
        assert not cached & (free | owned), "a cached page is also free or owned"
        assert len(free) + len(owned) + len(cached) == self.num_pages, "free + owned + cached != total"
        assert all(self._owner[p] is None for p in free | cached), "a free or cached page still names an owner"
        self._check_cached()

    def _check_owned(self, free: set[int]) -> set[int]:
        owned: set[int] = set()
        for request_id, pages in self._pages.items():
            for page in pages:
                assert page not in owned, f"page {page} has two owners"
                assert page not in free, f"page {page} is both free and owned"
                owner = self._owner[page]
                assert owner is not None and owner.request_id == request_id, f"page {page} owner record disagrees"
                assert owner.tenant == self._tenant[request_id], f"page {page} tenant record disagrees"
                owned.add(page)
        return owned

    def _check_cached(self) -> None:
        readers: dict[int, int] = dict.fromkeys(self._cached, 0)
        assert set(self._shared) == set(self._pages), "shared and own page records disagree on requests"
        for request_id, pages in self._shared.items():
            assert len(set(pages)) == len(pages), f"{request_id} names a cached page twice"
            for page in pages:
                assert page in readers, f"{request_id} reads page {page}, which is not cached"
                assert self._cached[page].namespace == self._namespace[request_id], \
                    f"{request_id} reads cached page {page} of another namespace"
                readers[page] += 1
        for page, cached in self._cached.items():
            assert cached.num_readers == readers[page], f"cached page {page}: reader count disagrees"
            assert (page in self._evictable) == (readers[page] == 0), f"cached page {page}: evictable disagrees"
            assert self._index.get(cached.key) == page, f"cached page {page}: index disagrees"
        assert len(self._index) == len(self._cached), "the prefix index names a page that is not cached"
