"""One worker thread that every tenant shares, serving them in turns.

A job is a function call that would hold the event loop too long if it ran there (tokenizing
a prompt, parsing a big body). The lane runs one job at a time on its thread; waiting jobs sit
in per-tenant queues served round-robin, so a tenant with many jobs queued delays another
tenant's job by at most the one job already running.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any


@dataclass
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    done: asyncio.Future[Any]


class FairQueue:
    """Jobs per tenant; `get` takes the next tenant in line and sends it to the back."""

    def __init__(self) -> None:
        self._by_tenant: dict[str, deque[_Job]] = {}  # insertion order is the line
        self._has_jobs = asyncio.Event()

    def put(self, tenant: str, job: _Job) -> None:
        self._by_tenant.setdefault(tenant, deque()).append(job)
        self._has_jobs.set()

    async def get(self) -> _Job:
        while not self._by_tenant:
            self._has_jobs.clear()
            await self._has_jobs.wait()
        tenant = next(iter(self._by_tenant))
        jobs = self._by_tenant.pop(tenant)
        job = jobs.popleft()
        if jobs:
            self._by_tenant[tenant] = jobs
        return job

    def take_all(self) -> list[_Job]:
        """Every job still waiting, the queue left empty."""
        jobs = [job for queued in self._by_tenant.values() for job in queued]
        self._by_tenant.clear()
        return jobs


class FairLane:
    """One thread fed by a `FairQueue` (started on first use, in the event loop). A job whose
    caller stopped waiting (its request cancelled) before its turn is skipped."""

    def __init__(self, name: str) -> None:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._queue: FairQueue | None = None
        self._serving: asyncio.Task[None] | None = None
        self._running: _Job | None = None

    async def run(self, tenant: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the lane's thread, in the tenant's turn; its result or its exception."""
        if self._queue is None:
            self._queue = FairQueue()
            self._serving = asyncio.create_task(self._serve(self._queue))
        job = _Job(fn, args, asyncio.get_running_loop().create_future())
        self._queue.put(tenant, job)
        return await job.done

    async def _serve(self, queue: FairQueue) -> None:
        while True:
            job = await queue.get()
            if not job.done.done():  # else its request was cancelled while it waited
                self._running = job
                await self._run(job)
                self._running = None

    async def _run(self, job: _Job) -> None:
        """The job's result or exception to its caller; the lane keeps neither once it is handed
        over (a parsed body may be big)."""
        try:
            result = await asyncio.get_running_loop().run_in_executor(self._worker, job.fn, *job.args)
        except Exception as exc:  # the job's own error (a refused body, a template's error), the caller's
            if not job.done.done():
                job.done.set_exception(exc)
            return
        if not job.done.done():
            job.done.set_result(result)

    def close(self) -> None:
        """Stop the worker (on the event loop's thread): the job running and every job still
        queued are cancelled, so their callers stop waiting (the running call itself finishes on
        the thread, its result dropped)."""
        if self._serving is not None:
            self._serving.cancel()
        waiting = ([] if self._queue is None else self._queue.take_all()) + \
            ([] if self._running is None else [self._running])
        for job in waiting:
            job.done.cancel()
        self._worker.shutdown(wait=False, cancel_futures=True)
