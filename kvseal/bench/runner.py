"""Drive a request list against a server at a fixed concurrency or arrival rate.

Contract: every request in the list is sent exactly once; at most `concurrency` are in flight
(None: no limit); with a finite `request_rate` sends start as a Poisson process of that rate
(seeded), otherwise all at once up to the concurrency limit. The run's duration is from the
first send to the last response, as `vllm bench serve` measures it. Every request is bounded
by the HTTP client's timeout, so a run always ends.
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

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.concurrency < 1:
            raise KvsealError(f"concurrency must be >= 1 (got {self.concurrency})")
        if not self.request_rate > 0:
            raise KvsealError(f"request rate must be > 0 requests/s (got {self.request_rate})")


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

    start = time.perf_counter()
    tasks = []
    for i, request in enumerate(requests):
        tasks.append(asyncio.create_task(one(request)))
        if math.isfinite(shape.request_rate) and i + 1 < len(requests):
            await asyncio.sleep(rng.expovariate(shape.request_rate))
    results = await asyncio.gather(*tasks)
    duration_s = time.perf_counter() - start
    bar.close()
    return RunOutcome(list(results), duration_s)
