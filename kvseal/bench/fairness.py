"""`kvseal bench serve --fairness`: does one tenant's long prompts raise another's TTFT?

Two tenants, told apart by their API keys. The short tenant (`--api-key`) runs the ordinary
workload (`--num-prompts` prompts of `--input-len` tokens at `--concurrency`) twice: first
alone, then while the long tenant (`--long-api-key`) keeps `--long-concurrency` requests of
`--long-input-len` tokens in flight. The long load starts before the second short run and
stops sending when it ends (its in-flight requests finish; at most `--long-max-requests`
are sent). Reported: the short tenant's p99 TTFT alone, with the long load, and their ratio
(`p99_ttft_ratio`), plus the full metrics of all three request streams.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvseal.bench.client import Endpoint, RequestResult, send_completion
from kvseal.bench.dataset import BenchRequest
from kvseal.bench.memory import ServerSample, ServerSampler, require_process
from kvseal.bench.metrics import compute_metrics
from kvseal.bench.runner import RunOutcome, check_server, http_client, run_requests
from kvseal.bench.serve import ServeBenchConfig, describe, make_requests, result_fields
from kvseal.errors import KvsealError


@dataclass(frozen=True)
class LongTenant:
    endpoint: Endpoint
    input_len: int = 4096
    output_len: int = 16
    concurrency: int = 2
    max_requests: int = 64

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.max_requests < 1:
            raise KvsealError(f"--long-concurrency and --long-max-requests must be >= 1 "
                              f"(got {self.concurrency}, {self.max_requests})")
        if self.endpoint.api_key is None:
            raise KvsealError("the fairness mode needs --long-api-key: the long tenant's key (the short "
                              "tenant's is --api-key)")


def bench_fairness(config: ServeBenchConfig, long: LongTenant) -> dict[str, Any]:
    if config.server_pid is not None:
        require_process(config.server_pid)
    rng = random.Random(config.seed)
    short = make_requests(config, 2 * config.num_prompts + 1, config.input_len, config.output_len, rng)
    longs = make_requests(config, long.max_requests, long.input_len, long.output_len, rng)
    alone, loaded, long_outcome, sample = asyncio.run(_measure(config, long, short, longs, rng))
    return _report(config, long, alone, loaded, long_outcome, sample)


def _report(config: ServeBenchConfig, long: LongTenant, alone: RunOutcome, loaded: RunOutcome,
            long_outcome: RunOutcome, sample: ServerSample) -> dict[str, Any]:
    alone_metrics = compute_metrics(alone.results, alone.duration_s)
    loaded_fields = result_fields(loaded, sample)
    alone_p99, loaded_p99 = alone_metrics["p99_ttft_ms"], loaded_fields["p99_ttft_ms"]
    return describe(config) | {
        "mode": "fairness",
        "short_alone_p99_ttft_ms": alone_p99,
        "short_with_long_p99_ttft_ms": loaded_p99,
        "p99_ttft_ratio": loaded_p99 / alone_p99 if alone_p99 > 0 else None,
        "short_alone": alone_metrics,
        "long_tenant": {"input_len": long.input_len, "output_len": long.output_len,
                        "concurrency": long.concurrency, "max_requests": long.max_requests}
        | compute_metrics(long_outcome.results, long_outcome.duration_s),
    } | loaded_fields


async def _measure(config: ServeBenchConfig, long: LongTenant, short: list[BenchRequest],
                   longs: list[BenchRequest], rng: random.Random,
                   ) -> tuple[RunOutcome, RunOutcome, RunOutcome, ServerSample]:
    n = config.num_prompts
    async with http_client(config.max_connections + long.concurrency + 1, config.request_timeout_s) as http:
        await check_server(http, config.endpoint, short[0])
        alone = await run_requests(http, config.endpoint, short[1:n + 1], config.shape, rng,
                                   progress=config.progress, description="short tenant alone")
        sampler = ServerSampler(http, config.endpoint.base_url, config.server_pid, config.admin_key)
        sampling = asyncio.create_task(sampler.run())
        load = _LongLoad(http, long, longs)
        loading = asyncio.create_task(load.run())
        try:
            loaded = await run_requests(http, config.endpoint, short[n + 1:], config.shape, rng,
                                        progress=config.progress, description="short tenant with long load")
        finally:
            load.stop()
            long_outcome = await loading
            sampler.stop()
            await sampling
    return alone, loaded, long_outcome, sampler.sample


class _LongLoad:
    """`concurrency` workers, each sending the next long prompt as soon as its last one ends."""

    def __init__(self, http: aiohttp.ClientSession, long: LongTenant, requests: list[BenchRequest]) -> None:
        self._http, self._long = http, long
        self._queue = list(reversed(requests))
        self._results: list[RequestResult] = []
        self._stopped = False

    def stop(self) -> None:
        self._stopped = True

    async def run(self) -> RunOutcome:
        start = time.perf_counter()
        await asyncio.gather(*(self._worker() for _ in range(self._long.concurrency)))
        return RunOutcome(self._results, time.perf_counter() - start)

    async def _worker(self) -> None:
        while not self._stopped and self._queue:
            request = self._queue.pop()
            self._results.append(await send_completion(self._http, self._long.endpoint, request))
