"""One streamed `/v1/completions` request, timed the way `vllm bench serve` times it.

Timing contract (vLLM's OpenAI-completions backend): the clock starts just before the request
is sent; every SSE chunk that carries `choices` is a timestamp: the first one gives TTFT, each
later one adds an inter-token latency (ITL, one per chunk); the request's latency (E2EL) ends
at the last such chunk. The output token count is the server's `usage.completion_tokens`
(asked for with `stream_options.include_usage`), or the number of content chunks when a
server sends no usage; the input count is `usage.prompt_tokens` when given (as vLLM counts).

The HTTP client is aiohttp, as `vllm bench serve`'s: the client runs on the same cores as the
server it measures, and its CPU per streamed token is taken from the server (docs/BENCHMARKS.md,
round 20). Events are split from the raw stream on blank lines, as SSE frames them; the events
of one read share its timestamp.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from kvseal.bench.dataset import BenchRequest


@dataclass
class RequestResult:
    input_len: int
    success: bool = False
    output_len: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


@dataclass(frozen=True)
class Endpoint:
    """Where and as whom requests go. `base_url` is the server's root (vLLM's bench form,
    http://host:port) or its OpenAI base URL (http://host:port/v1): the completions URL is the
    root + `endpoint` either way."""

    base_url: str
    model: str
    api_key: str | None = None
    endpoint: str = "/v1/completions"

    @property
    def root_url(self) -> str:
        return self.base_url.rstrip("/").removesuffix("/v1")

    @property
    def completions_url(self) -> str:
        return self.root_url + "/" + self.endpoint.lstrip("/")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def completion_body(endpoint: Endpoint, request: BenchRequest) -> dict[str, Any]:
    """Greedy, streamed, output forced to exactly `output_len` tokens (vLLM's extensions)."""
    return {
        "model": endpoint.model, "prompt": request.prompt_token_ids, "max_tokens": request.output_len,
        "min_tokens": request.output_len, "ignore_eos": True, "temperature": 0.0, "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_completion(http: aiohttp.ClientSession, endpoint: Endpoint, request: BenchRequest) -> RequestResult:
    """Send one request and time its stream; failures are results with `error` set, never raised."""
    result = RequestResult(input_len=request.input_len)
    start = time.perf_counter()
    try:
        async with http.post(endpoint.completions_url, json=completion_body(endpoint, request),
                             headers=endpoint.headers) as response:
            if response.status != 200:
                body = (await response.read()).decode(errors="replace")
                result.error = f"HTTP {response.status}: {body[:500]}"
                return result
            await _read_stream(response, start, result)
    except (aiohttp.ClientError, TimeoutError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


class _Stream:
    """Per-request state while its events arrive."""

    def __init__(self, start: float, result: RequestResult) -> None:
        self.start, self.last, self.result = start, start, result
        self.num_chunks = 0
        self.usage_tokens: int | None = None

    def event(self, data: dict[str, Any], now: float) -> None:
        if data.get("choices"):
            if self.num_chunks == 0:
                self.result.ttft_s = now - self.start
            else:
                self.result.itl_s.append(now - self.last)
            self.last = now
            self.num_chunks += 1
        elif usage := data.get("usage"):
            self.usage_tokens = int(usage["completion_tokens"])
            self.result.input_len = int(usage.get("prompt_tokens", self.result.input_len))


async def _read_stream(response: aiohttp.ClientResponse, start: float, result: RequestResult) -> None:
    stream = _Stream(start, result)
    pending = b""
    async for received in response.content.iter_any():
        now = time.perf_counter()
        *events, pending = (pending + received).replace(b"\r\n", b"\n").split(b"\n\n")
        for event in events:
            payload = _data(event)
            if not payload:
                continue
            if payload == b"[DONE]":
                _finish(stream)
                return
            data = json.loads(payload)
            if "error" in data:
                result.error = f"stream error: {json.dumps(data['error'])[:500]}"
                return
            stream.event(data, now)
    _finish(stream)


def _data(event: bytes) -> bytes:
    """The `data:` field of one SSE event (its lines joined), b"" for an event without one."""
    lines = [line.removeprefix(b"data:").strip() for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines)


def _finish(stream: _Stream) -> None:
    result = stream.result
    if stream.num_chunks == 0:
        result.error = "the stream ended without any output chunk"
        return
    result.success = True
    result.latency_s = stream.last - stream.start
    result.output_len = stream.usage_tokens if stream.usage_tokens is not None else stream.num_chunks
