"""The compile jobs waiting for a grammar worker: per tenant, first in first out, and the
tenants served round-robin, a tenant with a compile running skipped until it ends.

So with W workers, a tenant's grammar waits behind at most W - 1 other tenants' compiles
already running, each stopped at the time budget, and never behind another tenant's queue:
one tenant sending many (or slow) grammars delays only itself. Thread-safe: the engine loop
puts and removes jobs, the workers' threads take them.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvseal._testing.faults import Fault, is_active
from kvseal.errors import RequestRejected
from kvseal.types import StructuredOutput


@dataclass(eq=False)
class CompileJob:
    """One grammar to compile for one tenant; shared by that tenant's requests that wait for it."""

    tenant: str
    spec: StructuredOutput
    num_waiters: int = 1
    seq: int = 0  # arrival order (for the test-only shared-FIFO fault)
    is_abandoned: bool = False  # every waiter left: a running compile is stopped, a queued one dropped
    compiled: Any = None  # the xgrammar CompiledGrammar, once done without error
    error: RequestRejected | None = None
    finished: threading.Event = field(default_factory=threading.Event)


class FairCompileQueue:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._by_tenant: dict[str, deque[CompileJob]] = {}  # insertion order is the line
        self._running_tenants: set[str] = set()
        self._seq = itertools.count()
        self._is_closed = False

    def put(self, job: CompileJob) -> bool:
        """Queue `job`; False (not queued) once the line is closed."""
        with self._cond:
            if self._is_closed:
                return False
            job.seq = next(self._seq)
            self._by_tenant.setdefault(job.tenant, deque()).append(job)
            self._cond.notify()
            return True

    def take(self) -> CompileJob | None:
        """The next job to run (its tenant is then running), waiting for one; None once closed."""
        with self._cond:
            while not self._is_closed:
                job = self._pick()
                if job is not None:
                    self._running_tenants.add(job.tenant)
                    return job
                self._cond.wait()
            return None

    def done(self, job: CompileJob) -> None:
        """`job`, taken earlier, has ended: its tenant may run its next one."""
        with self._cond:
            self._running_tenants.discard(job.tenant)
            self._cond.notify_all()

    def remove(self, job: CompileJob) -> bool:
        """Drop a job still waiting; False if it was taken already (or never queued)."""
        with self._cond:
            jobs = self._by_tenant.get(job.tenant)
            if jobs is None or job not in jobs:
                return False
            jobs.remove(job)
            if not jobs:
                del self._by_tenant[job.tenant]
            return True

    def num_queued(self) -> int:
        with self._cond:
            return sum(len(jobs) for jobs in self._by_tenant.values())

    def close(self) -> list[CompileJob]:
        """Stop handing out jobs; returns those still waiting."""
        with self._cond:
            self._is_closed = True
            waiting = [job for jobs in self._by_tenant.values() for job in jobs]
            self._by_tenant.clear()
            self._cond.notify_all()
            return waiting

    def _pick(self) -> CompileJob | None:
        if is_active(Fault.SHARED_GRAMMAR_QUEUE):
            return self._pick_oldest()
        for tenant, jobs in self._by_tenant.items():
            if tenant not in self._running_tenants:
                return self._pop_first(tenant, jobs)
        return None

    def _pop_first(self, tenant: str, jobs: deque[CompileJob]) -> CompileJob:
        """The tenant's first job; the tenant goes to the back of the line (if it has more)."""
        job = jobs.popleft()
        del self._by_tenant[tenant]
        if jobs:
            self._by_tenant[tenant] = jobs
        return job

    def _pick_oldest(self) -> CompileJob | None:
        """The fault's broken line: one FIFO over every tenant, running tenants not skipped."""
        heads = [(jobs[0].seq, tenant) for tenant, jobs in self._by_tenant.items()]
        if not heads:
            return None
        _, tenant = min(heads)
        return self._pop_first(tenant, self._by_tenant[tenant])
