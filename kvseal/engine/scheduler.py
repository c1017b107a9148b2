"""Continuous-batching scheduler: chunked prefill and decode in one step, under a token budget.

Running requests go first, oldest first: each gets its next chunk (a decode is a chunk of one
token). When pages run out, the newest running request is preempted by recompute: its pages
are freed, its computed-token count reset to zero, and it goes back to the head of the queue
with the tokens it already produced, which it recomputes on resume. Waiting requests are then
admitted first-come first-served while budget, sequence slots and pages last.

Because admission (I1) bounds every request by max_model_len and start-up (I2) makes the
pool at least that large, the oldest request can always run alone: no deadlock.
"""

from __future__ import annotations

from collections import deque
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
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._make_room(request, request.num_computed_tokens + num_new, out):
                break  # the request itself was preempted; everything after it already was
            self._reserve(request, request.num_computed_tokens + num_new)
            out.chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new
            i += 1
        return budget

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
        self.kv.reserve(request.request_id, request.tenant, num_tokens)
        request.max_num_pages = max(request.max_num_pages, self.kv.num_pages_for(num_tokens))

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new = min(request.num_tokens, budget)
            if not self.kv.can_reserve(request.request_id, num_new):
                return
            self.waiting.popleft()
            self._reserve(request, num_new)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(ScheduledChunk(request, num_new))
            budget -= num_new

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
