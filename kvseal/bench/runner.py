"""Drive a request list against a server at a fixed concurrency or arrival rate.

Contract: every request in the list is sent exactly once; at most `concurrency` are in flight
(None: no limit); with a finite `request_rate` sends follow `send_times` (vLLM's arrival
schedule, seeded), otherwise all at once up to the concurrency limit. The run's duration is
from the start of the schedule to the last response, as `vllm bench serve` measures it. Every
request is bounded by the HTTP client's timeout, so a run always ends.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
from tqdm import tqdm

from kvseal.bench.client import Endpoint, RequestResult, send_completion
from kvseal.bench.dataset import BenchRequest
from kvseal.errors import KvsealError


@dataclass(frozen=True)
class LoadShape:
    concurrency: int | None = 32
    request_rate: float = math.inf
    burstiness: float = 1.0  # vLLM's: 1 is Poisson, below 1 burstier, above 1 more even, inf constant gaps

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise KvsealError(f"concurrency must be >= 1 (got {self.concurrency})")
        if not self.request_rate > 0:
            raise KvsealError(f"request rate must be > 0 requests/s (got {self.request_rate})")
        if not self.burstiness > 0:
            raise KvsealError(f"burstiness must be > 0 (got {self.burstiness})")


def send_times(num_requests: int, shape: LoadShape, rng: random.Random) -> list[float]:
    """When each request is sent, in seconds from the run's start, as `vllm bench serve` schedules
    them: every request (the first too) waits a gamma-distributed gap of mean 1/rate (shape
    `burstiness`: exponential gaps, a Poisson process, at 1; equal gaps at inf), and the times
    are then scaled so that the last send is at exactly num_requests / rate, so the offered load
    is the rate asked for whatever the seed. All zero for an infinite rate."""
    rate, burstiness = shape.request_rate, shape.burstiness
    if math.isinf(rate) or num_requests == 0:
        return [0.0] * num_requests
    times, now = [], 0.0
    for _ in range(num_requests):
        now += 1.0 / rate if math.isinf(burstiness) else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        times.append(now)
    scale = (num_requests / rate) / times[-1] if times[-1] > 0 else 1.0
    return [t * scale for t in times]


@dataclass
class RunOutcome:
    results: list[RequestResult]
    duration_s: float


def http_client(max_connections: int, request_timeout_s: float) -> aiohttp.ClientSession:
    """One connection pool per run; `request_timeout_s` bounds each request, its whole stream
    included. Made inside the run's event loop."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max_connections),
                                 timeout=aiohttp.ClientTimeout(total=request_timeout_s))


async def check_server(http: aiohttp.ClientSession, endpoint: Endpoint, request: BenchRequest) -> None:
    """Send one request before measuring; raise KvsealError with the server's answer if it fails."""
    result = await send_completion(http, endpoint, request)
    if not result.success:
        raise KvsealError(f"the test request to {endpoint.completions_url} failed ({result.error}); "
                          f"check --base-url, --model and --api-key")


async def run_requests(http: aiohttp.ClientSession, endpoint: Endpoint, requests: Sequence[BenchRequest],
                       shape: LoadShape, rng: random.Random, *, progress: bool = True,
                       description: str = "requests") -> RunOutcome:
    limit = asyncio.Semaphore(shape.concurrency) if shape.concurrency is not None else None
    bar = tqdm(total=len(requests), disable=not progress, desc=description)

    async def one(request: BenchRequest) -> RequestResult:
        if limit is None:
            result = await send_completion(http, endpoint, request)
        else:
            async with limit:
                result = await send_completion(http, endpoint, request)
        bar.update(1)
        return result

    schedule = send_times(len(requests), shape, rng)
    start = time.perf_counter()
    tasks = []
    for at_s, request in zip(schedule, requests):
        wait_s = at_s - (time.perf_counter() - start)  # to the schedule, not after the last send: no drift
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        tasks.append(asyncio.create_task(one(request)))
    results = await asyncio.gather(*tasks)
    duration_s = time.perf_counter() - start
    bar.close()
    return RunOutcome(list(results), duration_s)
