"""`kvseal bench serve`: one benchmark run, from arguments to a result dict (vLLM's key names)."""

from __future__ import annotations

import asyncio
import datetime
import math
import random
from dataclasses import dataclass
from typing import Any

from kvseal.bench.client import Endpoint
from kvseal.bench.dataset import BenchRequest, load_tokenizer, prompt_vocab, random_requests
from kvseal.bench.memory import ServerSample, ServerSampler, require_process
from kvseal.bench.metrics import compute_metrics, per_request_lists
from kvseal.bench.runner import LoadShape, RunOutcome, check_server, http_client, run_requests
from kvseal.errors import KvsealError


@dataclass(frozen=True)
class ServeBenchConfig:
    endpoint: Endpoint
    shape: LoadShape
    num_prompts: int = 200
    input_len: int = 256
    output_len: int = 128
    seed: int = 0
    tokenizer: str | None = None
    server_pid: int | None = None
    admin_key: str | None = None  # for /metrics on a kvseal server with --api-keys
    request_timeout_s: float = 600.0
    label: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        for flag, count in (("--num-prompts", self.num_prompts), ("--input-len", self.input_len),
                            ("--output-len", self.output_len)):
            if count < 1:
                raise KvsealError(f"{flag} must be >= 1 (got {count})")
        if not self.request_timeout_s > 0:  # NaN too
            raise KvsealError(f"--request-timeout must be > 0 seconds (got {self.request_timeout_s})")

    @property
    def max_connections(self) -> int:
        return self.shape.concurrency or self.num_prompts


def describe(config: ServeBenchConfig) -> dict[str, Any]:
    """The run's settings, as stored beside its metrics."""
    rate = config.shape.request_rate
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "backend": "openai", "label": config.label or config.endpoint.base_url,
        "base_url": config.endpoint.base_url, "model_id": config.endpoint.model,
        "tokenizer_id": config.tokenizer or "(default model)", "num_prompts": config.num_prompts,
        "input_len": config.input_len, "output_len": config.output_len,
        "request_rate": rate if math.isfinite(rate) else "inf",
        "burstiness": config.shape.burstiness if math.isfinite(config.shape.burstiness) else "inf",
        "max_concurrency": config.shape.concurrency,
        "seed": config.seed, "server_pid": config.server_pid,
    }


def make_requests(config: ServeBenchConfig, num_prompts: int, input_len: int, output_len: int,
                  rng: random.Random) -> list[BenchRequest]:
    vocab = prompt_vocab(load_tokenizer(config.tokenizer))
    return random_requests(vocab, num_prompts, input_len, output_len, rng)


def bench_serve(config: ServeBenchConfig) -> dict[str, Any]:
    if config.server_pid is not None:
        require_process(config.server_pid)
    rng = random.Random(config.seed)
    requests = make_requests(config, config.num_prompts + 1, config.input_len, config.output_len, rng)
    outcome, sample = asyncio.run(_measure(config, requests[0], requests[1:], rng))
    return describe(config) | result_fields(outcome, sample)


def result_fields(outcome: RunOutcome, sample: ServerSample) -> dict[str, Any]:
    metrics = compute_metrics(outcome.results, outcome.duration_s)
    server = {"peak_rss_bytes": sample.peak_rss_bytes, "kv_pages_total": sample.kv_pages_total,
              "peak_kv_pages_used": sample.peak_kv_pages_used}
    return metrics | server | per_request_lists(outcome.results)


async def _measure(config: ServeBenchConfig, test_request: BenchRequest, requests: list[BenchRequest],
                   rng: random.Random) -> tuple[RunOutcome, ServerSample]:
    async with http_client(config.max_connections + 1, config.request_timeout_s) as http:
        await check_server(http, config.endpoint, test_request)
        sampler = ServerSampler(http, config.endpoint.base_url, config.server_pid, config.admin_key)
        sampling = asyncio.create_task(sampler.run())
        try:
            outcome = await run_requests(http, config.endpoint, requests, config.shape, rng,
                                         progress=config.progress)
        finally:
            sampler.stop()
            await sampling
        return outcome, sampler.sample
