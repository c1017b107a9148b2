"""Continuous-batching scheduler: chunked prefill and decode in one step, under a token budget.

Each step first plans how many tokens every request gets (`_plan`), then walks the queues:

- Decodes first: every running request with one token left to compute gets it (oldest first,
  while the budget lasts), so a long prefill never holds back another request's next token.
- The budget left is shared between the tenants with prefill work (running prefills, then
  waiting requests) by `share_prefill_budget`: equal shares, a share a tenant cannot use goes
  to the others, oldest first inside a tenant, and no request gets more than
  `max_prefill_chunk_tokens` in one step. A tenant with many long prompts gets its share of
  the budget, not all of it.
- While more than one tenant has requests in flight (decoding ones count, and so does a tenant
  whose last request finished less than `TENANT_LINGER_S` ago: its next prompt usually follows),
  every tenant but the one with the least prefill left is held to `fair_share_tokens` of
  prefill work a step (a quarter of it in a step that carries that tenant's own prefill),
  counted by `chunk_cost`: a token deep in a long prompt costs more than one near its start,
  by its attention. A tenant's new short prompt then waits out a short step, not a long one,
  and shares its own step with little; the tenant with the long prompts still advances every
  step.
- Running requests, oldest first, get their planned chunk. When pages run out, the newest
  running request is preempted by recompute: its pages are freed, its computed-token count
  reset to zero, and it goes back to the head of the queue with the tokens it already
  produced, which it recomputes on resume. Victims come from the tail, which has not been
  scheduled yet in this step.
- Waiting requests with a planned chunk are admitted first-come first-served while sequence
  slots and pages last; the first that does not fit stops admission. An admitted request
  first takes the prefix-cache pages its tokens begin with (its own tenant's only, I5) and
  computes from there; a resumed preempted request finds its own published pages the same way.
- A waiting request whose next uncached page is being computed by a running prefill of its own
  tenant (the other choices of an `n` > 1 request, or the same system prompt sent twice at
  once) gets no chunk until that prefill has published it: it then starts on those pages
  instead of computing the same prefix beside it. Only the same tenant's prefills count (the
  cache keys carry the namespace, I5), and a prefill that is preempted or ends releases the
  requests waiting on it, so no request waits on one that will not run.

Because admission (I1) bounds every request by max_model_len and start-up (I2) makes the
pool at least that large, the oldest request can always run alone: no deadlock. It is never
starved of budget either: its tenant comes first in the sharing order and it comes first
inside its tenant, so it gets at least one token in every step that decodes leave budget in
(a tenant held to its fair share gets at least one token too).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvseal.config import SchedulerConfig
from kvseal.kvcache.manager import KVCacheManager
from kvseal.types import Request, RequestStatus, ScheduledChunk

# How long a tenant whose requests have all finished still counts as in flight for fair shares:
# an interactive client sends its next prompt within milliseconds, and the step that starts in
# between should not be a long one.
TENANT_LINGER_S = 1.0


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
        self.clock: Callable[[], float] = time.monotonic
        self._last_in_flight: dict[str, float] = {}  # tenant -> when it last had a request here

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
        running_prefills = [r for r in self.running if num_tokens_left(r) > 1]
        # A waiting request's prefix-cache hit is not prefill work: plan only what it computes.
        starting, num_cached = self._startable(running_prefills) if has_free_seat else ([], {})
        prefills = running_prefills + starting
        plan = {r.request_id: 1 for r in decodes}
        plan.update(share_prefill_budget(prefills, budget - len(decodes), self.config.max_prefill_chunk_tokens,
                                         num_cached, self._fair_share_caps(), self.config.attention_cost_context))
        return plan

    def _startable(self, running_prefills: list[Request]) -> tuple[list[Request], dict[str, int]]:
        """The waiting requests that may start this step, in queue order, and the tokens each
        finds in the prefix cache: not those whose next uncached page one of `running_prefills`,
        or a request starting before them (of those the free seats can take), will publish."""
        in_flight = self.kv.pages_in_flight(running_prefills) if self.waiting else set()
        num_free_seats = self.config.max_num_seqs - len(self.running)
        starting: list[Request] = []
        num_cached: dict[str, int] = {}
        for request in self.waiting:
            num_hit = len(self.kv.match_prefix(request))
            if self.kv.waits_for_in_flight(request, num_hit, in_flight):
                continue
            starting.append(request)
            num_cached[request.request_id] = num_hit * self.kv.page_size
            if len(starting) <= num_free_seats:  # (one that cannot be admitted this step publishes nothing)
                in_flight |= self.kv.pages_in_flight([request])
        return starting, num_cached

    def _fair_share_caps(self) -> dict[str, int]:
        """Tenant -> the most prefill work it gets this step: while several tenants have requests
        in flight (or had, less than TENANT_LINGER_S ago), `fair_share_tokens` for all but the
        one with the least prefill left (the first such, in queue order), a quarter of it while
        that one has prefill of its own; no cap for anyone when one tenant is alone."""
        now = self.clock()
        prefill_left: dict[str, int] = {}
        for request in (*self.running, *self.waiting):
            left = num_tokens_left(request)
            decoding = request.status is RequestStatus.RUNNING and left == 1
            prefill_left[request.tenant] = prefill_left.get(request.tenant, 0) + (0 if decoding else left)
        self._last_in_flight.update(dict.fromkeys(prefill_left, now))
        self._last_in_flight = {tenant: seen for tenant, seen in self._last_in_flight.items()
                                if now - seen < TENANT_LINGER_S}
        for tenant in self._last_in_flight:
            prefill_left.setdefault(tenant, 0)  # lingering: no prefill left, so it is the lightest
        if len(prefill_left) < 2:
            return {}
        lightest = min(prefill_left, key=prefill_left.__getitem__)
        share = self.config.fair_share_tokens
        if prefill_left[lightest]:  # its prompt is in this step: what others add delays its first token
            share = max(1, share // 4)
        return {tenant: share for tenant in prefill_left if tenant != lightest}

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
            if request.first_scheduled_s is None:  # a preempted request keeps its first (vLLM's)
                request.first_scheduled_s = time.monotonic()
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
                         num_cached: Mapping[str, int] | None = None, tenant_caps: Mapping[str, int] | None = None,
                         attention_cost_context: int = 4096) -> dict[str, int]:
    """Split `budget` tokens between `requests` that want to prefill; returns request id -> tokens.
    `num_cached`: tokens of a request that a prefix-cache hit will cover (not wanted).
    `tenant_caps`: tenant -> the most work, by `chunk_cost` over `attention_cost_context`, its
    requests get together.

    Promises: no request gets more than `max_chunk_tokens` nor more than it has left; the total
    is at most `budget`; a capped tenant's chunks cost at most its cap, except that its first
    request gets at least one token; tenants get equal shares, and a share a tenant cannot use
    goes to the others; inside a tenant, requests are served in the order given. Tenants are
    visited in the order of their first request, so the first tenant gets any remainder that
    does not divide.
    """
    cached = num_cached or {}
    caps = tenant_caps or {}
    wants: dict[str, list[tuple[str, int]]] = {}
    cost_left = {tenant: float(cap) for tenant, cap in caps.items()}
    for request in requests:
        skip = cached.get(request.request_id, 0)
        want = min(num_tokens_left(request) - skip, max_chunk_tokens)
        tenant_wants = wants.setdefault(request.tenant, [])
        if request.tenant in caps:
            start = request.num_computed_tokens + skip
            want = min(want, tokens_within(start, cost_left[request.tenant], attention_cost_context))
            want = want or int(not tenant_wants)  # the tenant's first request advances by one token at least
            # a request the share cannot afford ends the tenant's turn: no younger one goes before it
            cost_left[request.tenant] -= chunk_cost(start, want, attention_cost_context) if want else math.inf
        if want > 0:
            tenant_wants.append((request.request_id, want))
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


def chunk_cost(start: int, num_tokens: int, attention_cost_context: int) -> float:
    """Work of computing positions [start, start + num_tokens), in tokens of linear work: each
    token costs 1 for its linears and (its context length) / `attention_cost_context` for its
    attention (see `ModelConfig.attention_cost_context`)."""
    contexts = num_tokens * start + num_tokens * (num_tokens + 1) / 2
    return num_tokens + contexts / attention_cost_context


def tokens_within(start: int, cost: float, attention_cost_context: int) -> int:
    """The most tokens from position `start` on whose `chunk_cost` is at most `cost`."""
    if cost <= 0:
        return 0
    k = attention_cost_context
    b = 1 + (start + 0.5) / k  # chunk_cost(n) = n * b + n * n / (2k): solve it for n
    n = int((math.sqrt(b * b + 2 * cost / k) - b) * k)
    while n > 0 and chunk_cost(start, n, k) > cost:
        n -= 1
    while chunk_cost(start, n + 1, k) <= cost:
        n += 1
    return n
