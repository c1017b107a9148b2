"""KV cache manager: the allocator and the pool together, in the scheduler's terms.

The scheduler asks for room in tokens; the manager turns that into whole pages, applies the
scrub policy (I7) at the two moments it can act (hand-out and take-back), and keeps the write
records (`records.py`) that answer, before every forward and in every configuration, "does
each sequence read and write only its own pages, and is every position it attends to
written, per layer, by it?" (I3, I4).

Checked mode goes deeper: it poisons pages with NaN while they are free (a read of a page the
reader does not own shows up as NaN), zeroes them when handed out, and verifies every context
slot of every layer against per-slot records before the forward runs.

`num_pages_scrubbed` counts every page the policy overwrote since start-up: zeroed on free or
eviction (`kv_scrub="free"`), zeroed on hand-out (`"alloc"` or checked mode), NaN-poisoned on
free or eviction (checked mode; a page freed and handed out again counts twice there). With
`kv_scrub="off"` and checked mode off it stays 0: the next owner overwrites a page's KV. The
start-up poison of the whole pool is not counted.

Writes that do not come from this engine's forward (KV arriving through a transport) are
reported with `record_written`; `written_prefix` tells what is covered.

Prefix caching (I5, on unless `enable_prefix_caching` is off): `publish_written` hands each
full page of a request that every layer has written to the cache, keyed by the request's
namespace and the chained hash of its tokens; `acquire_prefix` starts a new (or preempted)
request on the cached pages its tokens begin with, shared read-only. Scrub and poison (I7)
apply when a cached page is evicted, never when it goes into the cache. `pages_in_flight` and
`waits_for_in_flight` let the scheduler start a request after a prefill of the same prefix in
its own namespace has published it, rather than beside it.

Forgetting a tenant (`forget_tenant`: its name was removed from the frontend's keys, and a
key added later under the same name may be another customer's): every cached page a request of
that name published, in every namespace, goes back to the free list and is scrubbed as an
evicted page is, now if no one reads it, else when its last reader ends. Requests of the name
that reached the engine before are closed to the cache (they neither read nor publish a page);
requests after it carry the next `cache_epoch`, which is part of their namespace (I5).
"""

from __future__ import annotations

import contextlib
import math

import torch

from kvseal._testing.faults import Fault, is_active
from kvseal.config import CacheConfig
from kvseal.errors import IsolationViolation
from kvseal.kvcache.allocator import PageAllocator
from kvseal.kvcache.mirror import LoggedRecords, OwnershipEvent
from kvseal.kvcache.pool import KVPool
from kvseal.kvcache.prefix_cache import PageKey, extend_page_hashes, page_key
from kvseal.kvcache.records import ForwardWrites, RecordKernels, WriteRecords
from kvseal.types import ForwardBatch, Request


class KVCacheManager:
    def __init__(self, config: CacheConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                 record_kernels: RecordKernels | None = None, mirrored: bool = False,
                 pool: KVPool | None = None) -> None:
        """record_kernels: the ops layer's kernels for the always-on check and the records'
        growth (`Ops.record_kernels`); None: torch ops, with the same answers. `mirrored`: log
        every ownership change for other tensor-parallel ranks (`mirror.py`). `pool`: one built
        ahead (its memory committed while the weights loaded), unused, of these dimensions;
        None: built here."""
        self.config = config
        self.page_size = config.page_size
        self.allocator = PageAllocator(config.num_pages)
        self.num_layers = num_layers
        records_type = LoggedRecords if mirrored else WriteRecords
        self.records = records_type(num_layers, config.num_pages, config.page_size, track_slots=config.check_kv,
                                    kernels=record_kernels, device=config.device)
        if pool is None:
            pool = KVPool(num_layers, config.num_pages, config.page_size, num_kv_heads, head_dim, config.dtype,
                          device=config.device)
        elif not pool.has_geometry(num_layers, config.num_pages, config.page_size, num_kv_heads, head_dim,
                                   config.dtype) or pool.observer is not None:
            raise ValueError("the pool built ahead is not this cache's (other dimensions) or is in use")
        pool.wait_touched()
        pool.observer = self.records
        self.pool = pool
        self.num_pages_scrubbed = 0  # pages overwritten by the scrub policy (I7) since start-up
        self._cache_epochs: dict[str, int] = {}  # tenant -> times its cache was forgotten (only those ever)
        if config.check_kv:
            self.pool.fill(list(range(config.num_pages)), float("nan"))

    @property
    def num_free_pages(self) -> int:
        return self.allocator.num_free_pages

    @property
    def num_used_pages(self) -> int:
        """Pages owned by requests or held by the prefix cache with readers."""
        return self.allocator.num_pages - self.allocator.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        return self.allocator.num_cached_pages

    def num_pages_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def num_missing_pages(self, request_id: str, num_tokens: int) -> int:
        return max(0, self.num_pages_for(num_tokens) - len(self.allocator.pages_of(request_id)))

    def can_reserve(self, request_id: str, num_tokens: int) -> bool:
        return self.allocator.can_allocate(self.num_missing_pages(request_id, num_tokens))

    def reserve(self, request_id: str, tenant: str, num_tokens: int, namespace: str = "",
                consecutive: bool = False) -> None:
        """Make the request hold enough pages for `num_tokens` tokens (evicting least recently
        used cached pages if the free list is short). `consecutive`: new pages as one run of
        consecutive page ids when the free list has one (`PageAllocator.append`)."""
        missing = self.num_missing_pages(request_id, num_tokens)
        self.evict(missing - self.allocator.num_unused_pages)
        if not self.allocator.owns(request_id):
            new_pages = self.allocator.allocate(request_id, tenant, missing, namespace, consecutive)
        else:
            new_pages = self.allocator.append(request_id, missing, consecutive)
        if not new_pages:
            return
        generations = [self.allocator.owner_of(p).generation for p in new_pages]  # type: ignore[union-attr]
        self.records.hand_out(request_id, new_pages, generations, namespace)
        if self.config.kv_scrub == "alloc" or self.config.check_kv:
            # Checked mode: zero the NaN poison on hand-out. Attention reads whole pages and
            # masks the unwritten tail, and a masked NaN would still poison the sum.
            self._fill(new_pages, 0.0)
            self.num_pages_scrubbed += len(new_pages)

    def free(self, request_id: str) -> list[int]:
        """Release every page of the request at once: its own pages scrubbed or poisoned per
        config, the cached pages it read left in the cache (evictable once no one reads them)."""
        closed = [p for p in self.allocator.shared_pages_of(request_id) if self._is_forgotten(p)] \
            if self._cache_epochs else []
        pages = self.allocator.free(request_id)
        self.records.take_back(request_id, pages)
        self._scrub(pages)
        self._drop_unread(closed)  # a forgotten tenant's page leaves with its last reader
        return pages

    def evict(self, num_pages: int) -> list[int]:
        """Evict up to `num_pages` unread cached pages, least recently used first, scrubbed or
        poisoned per config (I7). Returns them (now free)."""
        if num_pages <= 0:
            return []
        pages = self.allocator.evict(num_pages)
        if pages:
            self.records.evict(pages)
            self._scrub(pages)
        return pages

    def _drop_unread(self, pages: list[int]) -> list[int]:
        """Those of the cached `pages` no one reads leave the cache now, scrubbed or poisoned per
        config (I7), whatever their age. Returns them (now free)."""
        if not pages:
            return []
        dropped = self.allocator.evict_unread(pages)
        if dropped:
            self.records.evict(dropped)
            self._scrub(dropped)
        return dropped

    def _scrub(self, pages: list[int]) -> None:
        if not pages:
            return
        if self.config.check_kv:
            self._fill(pages, float("nan"))
        elif self.config.kv_scrub == "free":
            self._fill(pages, 0.0)
        else:
            return
        self.num_pages_scrubbed += len(pages)

    def _fill(self, pages: list[int], value: float) -> None:
        self.pool.fill(pages, value)
        if isinstance(self.records, LoggedRecords):
            self.records.log_fill(pages, value)

    def drain_events(self) -> list[OwnershipEvent]:
        """The ownership changes since the last call, for the other tensor-parallel ranks
        (empty unless `mirrored`)."""
        return self.records.drain() if isinstance(self.records, LoggedRecords) else []

    # --- forgetting a tenant's cache -------------------------------------------------------

    def cache_epoch(self, tenant: str) -> int:
        """How many times this engine was told to forget `tenant`'s cache (0: never). A request
        takes the value as it reaches the engine (`Request.cache_epoch`, part of its namespace),
        so requests of a name removed and added again never share a page."""
        return self._cache_epochs.get(tenant, 0)

    def is_cache_closed(self, request: Request) -> bool:
        """Whether the request reached this engine before its tenant's cache was last forgotten:
        then it neither reads nor publishes a cached page."""
        return request.cache_epoch != self.cache_epoch(request.tenant)

    def forget_tenant(self, tenant: str) -> list[int]:
        """Drop `tenant`'s prefix cache (see the module): every cached page a request of that name
        published, in any namespace (any cache_salt, any earlier epoch), that no one reads is free
        and scrubbed per config when this returns; one still read leaves with its last reader
        (`free`). The tenant's requests already here are closed to the cache from now on
        (`is_cache_closed`); those that arrive later take the next epoch and cache as usual.
        Returns the pages freed now."""
        self._cache_epochs[tenant] = self.cache_epoch(tenant) + 1
        if is_active(Fault.FORGET_KEEPS_CACHE):
            return []  # test-only: the forgotten tenant's pages stay cached
        return self._drop_unread(self.allocator.cached_pages_of(tenant))

    def _is_forgotten(self, page: int) -> bool:
        """Whether the page is cached by a request closed to the cache by a later forget."""
        cached = self.allocator.cached_page(page)
        return cached is not None and cached.cache_epoch != self.cache_epoch(cached.tenant)

    # --- prefix cache ----------------------------------------------------------------------

    def acquire_prefix(self, request: Request) -> int:
        """Start a request that holds no pages on the cached pages its tokens begin with, in its
        own namespace; returns how many tokens they cover (a multiple of page_size, 0 with the
        cache off). At least the last token is always left to compute: it must be sampled from."""
        assert not self.allocator.owns(request.request_id), "only a request holding no pages starts on the cache"
        pages = self.match_prefix(request)
        if not pages:
            return 0
        self.allocator.share(request.request_id, request.tenant, request.cache_namespace, pages)
        self.records.share(request.request_id, request.cache_namespace, len(pages))
        return len(pages) * self.page_size

    def can_reserve_on_prefix(self, request: Request, num_tokens: int) -> bool:
        """Whether a request that holds nothing could start on its cache hit (`acquire_prefix`)
        and then hold `num_tokens` tokens: the hit's pages need no new page, but those no one
        reads yet stop counting as evictable once it reads them."""
        hit = self.match_prefix(request)
        num_unread = sum(1 for page in hit if (c := self.allocator.cached_page(page)) and c.num_readers == 0)
        return self.allocator.can_allocate(self.num_pages_for(num_tokens) - len(hit) + num_unread)

    def match_prefix(self, request: Request) -> list[int]:
        """The cached pages, in order, that the request's leading full pages hit (no side effect).
        Nothing for a request still computing its prompt logprobs: it needs every prompt position's logits."""
        if not self.config.enable_prefix_caching or request.needs_prompt_logprobs or self.is_cache_closed(request):
            return []
        max_pages = (request.num_tokens - 1) // self.page_size
        pages: list[int] = []
        for page_hash in self._page_hashes(request, max_pages):
            page = self.allocator.lookup(page_key(request.cache_namespace, page_hash))
            if page is None:
                break
            pages.append(page)
        return pages

    def pages_in_flight(self, prefilling: list[Request]) -> set[PageKey]:
        """The keys of every full page of the requests' tokens: what those running prefills
        publish as they compute them (empty with the cache off)."""
        if not self.config.enable_prefix_caching:
            return set()
        return {page_key(r.cache_namespace, page_hash) for r in prefilling if not self.is_cache_closed(r)
                for page_hash in self._page_hashes(r, r.num_tokens // self.page_size)}

    def waits_for_in_flight(self, request: Request, num_hit: int, in_flight: set[PageKey]) -> bool:
        """Whether the first page a waiting request misses in the cache (after its `num_hit`
        pages that hit, `match_prefix`) is one a running prefill will publish (`pages_in_flight`):
        then it does better to start after it than to compute the same prefix beside it. Keys
        carry the namespace (I5): only a prefill of the request's own tenant counts, so no
        tenant's waiting depends on another's prompts."""
        if not in_flight or self.is_cache_closed(request):
            return False
        if request.needs_prompt_logprobs or num_hit >= (request.num_tokens - 1) // self.page_size:
            return False
        first_missed = self._page_hashes(request, num_hit + 1)[num_hit]
        return page_key(request.cache_namespace, first_missed) in in_flight

    def publish_written(self, request: Request) -> None:
        """Hand every full own page of the request that is written in every layer to the cache.

        Call it after each forward that computed tokens of the request. A page whose key is
        already cached (the same prefix computed twice at once) stays the request's own, and
        so does every later page: a page table is shared pages, then own pages."""
        request_id = request.request_id
        num_shared = self.allocator.num_shared_pages_of(request_id)
        if not self.config.enable_prefix_caching or request.num_computed_tokens < (num_shared + 1) * self.page_size:
            return
        if self.is_cache_closed(request):
            return  # its tenant's cache was forgotten since it arrived
        num_full = min(self.num_written_tokens(request_id), request.num_computed_tokens) // self.page_size
        num_full = min(num_full, len(self.allocator.pages_of(request_id)))
        hashes = self._page_hashes(request, num_full)
        for index in range(num_shared, num_full):
            key = page_key(request.cache_namespace, hashes[index])
            if self.allocator.lookup(key) is not None:
                return
            self.records.publish(request_id, self.allocator.own_pages_of(request_id)[0], index,
                                 request.cache_namespace)
            self.allocator.publish(request_id, key, request.cache_epoch)

    def _page_hashes(self, request: Request, num_pages: int) -> list[bytes]:
        if len(request.page_hashes) < num_pages:  # all_token_ids copies the tokens: only when needed
            extend_page_hashes(request.page_hashes, request.all_token_ids, self.page_size, num_pages)
        return request.page_hashes[:num_pages]

    def slots(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """Pool slot of each position in [start, end) of the request: [end - start] int64."""
        return torch.tensor(self.slot_list(request_id, start, end), dtype=torch.int64)

    def slot_list(self, request_id: str, start: int, end: int) -> list[int]:
        """`slots` as a list (a step builds one tensor for the whole batch from these). Raises
        IndexError for a position past the request's pages."""
        pages, page_size = self._page_table(request_id), self.page_size
        return [pages[pos // page_size] * page_size + pos % page_size for pos in range(start, end)]

    def block_table(self, request_id: str, num_tokens: int) -> torch.Tensor:
        """The request's pages covering its first `num_tokens` positions, in order."""
        return torch.tensor(self._page_table(request_id)[: self.num_pages_for(num_tokens)], dtype=torch.int64)

    def _page_table(self, request_id: str) -> list[int]:
        """The request's pages in position order: what its reads and writes go through."""
        pages = self.allocator.pages_of(request_id)
        if pages and is_active(Fault.FOREIGN_PAGE):
            # Test-only: a corrupted block table that names another request's page.
            foreign = next((p for p in range(self.allocator.num_pages)  # an owned page, never a cached one
                            if (o := self.allocator.owner_of(p)) is not None and o.request_id != request_id), None)
            pages[0] = pages[0] if foreign is None else foreign
        return pages

    def num_written_tokens(self, request_id: str) -> int:
        """How many leading positions of the request hold KV written, in every layer, in the
        current ownership of its pages."""
        return min(self.written_prefix(request_id))

    def written_prefix(self, request_id: str) -> list[int]:
        """Per layer, how many leading positions of the request hold KV written in the current
        ownership of its pages (all 0 for a request that owns no pages).

        Written means: by a forward of this engine (recorded as each layer's write happens) or
        reported through `record_written`. A request's prefix starts at 0 when it gets its
        first pages and is forgotten when they are freed (finish, abort, preemption).
        """
        return self.records.written_prefix(request_id)

    def record_written(self, request_id: str, layer: int, start: int, end: int) -> None:
        """Record that KV for positions [start, end) of `layer` was written into the request's
        own pages by something other than this engine's forward (a KV transport).

        Only contiguous growth is accepted: `start` must equal `written_prefix(request_id)[layer]`
        and `end` must lie within the pages the request owns. Anything else (unknown request,
        a gap, a rewrite, an empty range, no such layer) raises `IsolationViolation`, and the
        caller must abort the request. Call it only after the data is in the pool.
        """
        slots = self.slots(request_id, start, end) if self.records.track_slots and end > start else None
        self.records.record(request_id, layer, start, end, slots)

    def plan_writes(self, request_ids: list[str], starts: list[int], ends: list[int]) -> ForwardWrites:
        """What a forward will write: positions [starts[i], ends[i]) of request_ids[i]."""
        return self.records.plan(request_ids, starts, ends)

    def check_forward(self, writes: ForwardWrites, batch: ForwardBatch) -> list[IsolationViolation]:
        """The always-on check (I3, I4), O(1) per sequence plus one gather over the batch's
        pages: one violation per sequence that names a page it does not own or would attend
        to a position that no layer-complete write covers. The batch must not run as is."""
        refused = self.records.check_forward(writes, batch)
        return [IsolationViolation(writes.request_ids[i], why) for i, why in sorted(refused.items())]

    def recording(self, writes: ForwardWrites) -> contextlib.AbstractContextManager[None]:
        """Run the forward that performs `writes` inside this: each layer's pool write then
        advances that layer's written prefixes."""
        return self.records.recording(writes)

    def verify_readable(self, request_id: str, context_slots: torch.Tensor, new_slots: torch.Tensor) -> None:
        """Checked mode (I3, I4), per slot: every context slot must lie in a page the allocator
        says the request owns and, in every layer, be written by it, either earlier in this
        ownership period or by this forward (`new_slots`). Raises IsolationViolation."""
        owned = set(self.allocator.pages_of(request_id))
        foreign = sorted({p for p in (context_slots // self.page_size).tolist() if p not in owned})
        if foreign:
            raise IsolationViolation(request_id, f"request {request_id} would read pages {foreign[:8]} it does not own")
        unwritten = self.records.unwritten_slots(context_slots, new_slots)  # [num_layers, num_context]
        if bool(unwritten.any()):
            layer, first = (int(x) for x in unwritten.nonzero()[0])
            raise IsolationViolation(
                request_id,
                f"request {request_id} would read {int(unwritten.any(0).sum())} KV slots it never wrote "
                f"(first at position {first}, layer {layer}); refusing to run the forward",
            )

    def check_integrity(self) -> None:
        self.allocator.check_integrity()
        allocator = self.allocator
        holders = {r: (allocator.pages_of(r)[:allocator.num_shared_pages_of(r)], allocator.own_pages_of(r))
                   for r in allocator.owner_ids()}
        self.records.check_integrity(holders, allocator.cached_namespaces())
        for page in allocator.cached_namespaces():
            cached = allocator.cached_page(page)
            assert cached is not None and (cached.num_readers > 0 or not self._is_forgotten(page)), \
                f"cached page {page} of a forgotten tenant's cache outlived its readers"
