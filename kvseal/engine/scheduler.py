"""Continuous-batching scheduler: chunked prefill and decode in one step, under a token budget.

Each step first plans how many tokens every request gets (`_plan`), then walks the queues:

- Decodes first: every running request with one token left to compute gets it (oldest first,
  while the budget lasts), so a long prefill never holds back another request's next token.
- The budget left is shared between the tenants with prefill work (running prefills, then
  waiting requests) by `share_prefill_budget`: equal shares, a share a tenant cannot use goes
  to the others, oldest first inside a tenant, and no request gets more than
  `max_prefill_chunk_tokens` in one step. A tenant with many long prompts gets its share of
  the budget, not all of it.
- Running requests, oldest first, get their planned chunk. When pages run out, the newest
  running request is preempted by recompute: its pages are freed, its computed-token count
  reset to zero, and it goes back to the head of the queue with the tokens it already
  produced, which it recomputes on resume. Victims come from the tail, which has not been
  scheduled yet in this step.
- Waiting requests with a planned chunk are admitted first-come first-served while sequence
  slots and pages last; the first that does not fit stops admission. An admitted request
  first takes the prefix-cache pages its tokens begin with (its own tenant's only, I5) and
  computes from there; a resumed preempted request finds its own published pages the same way.

Because admission (I1) bounds every request by max_model_len and start-up (I2) makes the
pool at least that large, the oldest request can always run alone: no deadlock. It is never
starved of budget either: its tenant comes first in the sharing order and it comes first
inside its tenant, so it gets at least one token in every step that decodes leave budget in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvseal.config import SchedulerConfig
from kvseal.kvcache.manager import KVCacheManager
from kvseal.types import Request, RequestStatus, ScheduledChunk


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Take over a request that already owns pages holding its computed KV (a PD handoff).
        It runs from its next token on, like any running request (and may be preempted)."""
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        plan = self._plan()
        self._schedule_running(out, plan)
        if not out.preempted:
            self._schedule_waiting(out, plan)
        return out

    def _plan(self) -> dict[str, int]:
        """Tokens per request id this step: decodes first, the rest shared between tenants."""
        budget = self.config.max_num_batched_tokens
        decodes = [r for r in self.running if num_tokens_left(r) == 1][:budget]
        has_free_seat = len(self.running) < self.config.max_num_seqs  # else no waiting request can start
        starting = list(self.waiting) if has_free_seat else []
        prefills = [r for r in self.running if num_tokens_left(r) > 1] + starting
        # A waiting request's prefix-cache hit is not prefill work: plan only what it computes.
        num_cached = {r.request_id: len(self.kv.match_prefix(r)) * self.kv.page_size for r in starting}
        plan = {r.request_id: 1 for r in decodes}
        plan.update(share_prefill_budget(prefills, budget - len(decodes), self.config.max_prefill_chunk_tokens,
                                         num_cached))
        return plan

    def _schedule_running(self, out: SchedulerOutput, plan: dict[str, int]) -> None:
        i = 0
        while i < len(self.running):
            request = self.running[i]
            num_new = plan.get(request.request_id, 0)
            if num_new:
                if not self._make_room(request, request.num_computed_tokens + num_new, out):
                    break  # the request itself was preempted; everything after it already was
                self._reserve(request, request.num_computed_tokens + num_new)
                out.chunks.append(ScheduledChunk(request, num_new))
            i += 1

    def _make_room(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Preempt newest-first until `request` can hold `num_tokens`; False if it was preempted."""
        while not self.kv.can_reserve(request.request_id, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _reserve(self, request: Request, num_tokens: int) -> None:
        self.kv.reserve(request.request_id, request.tenant, num_tokens, request.cache_namespace)
        request.max_num_pages = max(request.max_num_pages, self.kv.num_pages_for(num_tokens))

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _schedule_waiting(self, out: SchedulerOutput, plan: dict[str, int]) -> None:
        for request in [r for r in self.waiting if plan.get(r.request_id, 0)]:
            if len(self.running) >= self.config.max_num_seqs:
                return
            num_cached = self.kv.acquire_prefix(request)
            num_new = min(plan[request.request_id], request.num_tokens - num_cached)
            if not self.kv.can_reserve(request.request_id, num_cached + num_new):
                self.kv.free(request.request_id)  # gives the cached pages back; it holds nothing else
                return
            self.waiting.remove(request)
            request.num_computed_tokens = num_cached
            if request.num_preemptions == 0:
                request.num_cached_tokens = num_cached
            self._reserve(request, num_cached + num_new)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, num_new))

    def finish(self, request: Request) -> list[int]:
        """Take a request out of every queue and free its pages at once."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        return self.kv.free(request.request_id)

    def find(self, request_id: str) -> Request | None:
        for request in (*self.running, *self.waiting):
            if request.request_id == request_id:
                return request
        return None


def num_tokens_left(request: Request) -> int:
    """Tokens of `request` whose KV is not computed yet (1 for a request that is decoding)."""
    return request.num_tokens - request.num_computed_tokens


def share_prefill_budget(requests: list[Request], budget: int, max_chunk_tokens: int,
                         num_cached: Mapping[str, int] | None = None) -> dict[str, int]:
    """Split `budget` tokens between `requests` that want to prefill; returns request id -> tokens.
    `num_cached`: tokens of a request that a prefix-cache hit will cover (not wanted).

    Promises: no request gets more than `max_chunk_tokens` nor more than it has left; the total
    is at most `budget`; tenants get equal shares, and a share a tenant cannot use goes to the
    others; inside a tenant, requests are served in the order given. Tenants are visited in the
    order of their first request, so the first tenant gets any remainder that does not divide.
    """
    cached = num_cached or {}
    wants: dict[str, list[tuple[str, int]]] = {}
    for request in requests:
        wants.setdefault(request.tenant, []).append(
            (request.request_id, min(num_tokens_left(request) - cached.get(request.request_id, 0), max_chunk_tokens)))
    shares = _equal_shares({tenant: sum(n for _, n in w) for tenant, w in wants.items()}, budget)
    grants: dict[str, int] = {}
    for tenant, tenant_wants in wants.items():
        left = shares[tenant]
        for request_id, want in tenant_wants:
            if left == 0:
                break
            grants[request_id] = min(want, left)
            left -= grants[request_id]
    return grants


def _equal_shares(demands: dict[str, int], budget: int) -> dict[str, int]:
    """Water-filling: each round splits what is left evenly among the tenants still wanting,
    none above its demand; rounds repeat until the budget or the demands run out."""
    shares = dict.fromkeys(demands, 0)
    wanting = [tenant for tenant, demand in demands.items() if demand > 0]
    left = budget
    while left > 0 and wanting:
        share = max(1, left // len(wanting))
        for tenant in list(wanting):
            given = min(share, demands[tenant] - shares[tenant], left)
            shares[tenant] += given
            left -= given
            if shares[tenant] == demands[tenant]:
                wanting.remove(tenant)
    return shares
