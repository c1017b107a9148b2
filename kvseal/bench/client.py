"""One streamed `/v1/completions` request, timed the way `vllm bench serve` times it.

Timing contract (vLLM's OpenAI-completions backend): the clock starts just before the request
is sent; every SSE chunk that carries `choices` is a timestamp: the first one gives TTFT, each
later one adds an inter-token latency (ITL, one per chunk); the request's latency (E2EL) ends
at the last such chunk. The output token count is the server's `usage.completion_tokens`
(asked for with `stream_options.include_usage`), or the number of content chunks when a
server sends no usage; the input count is `usage.prompt_tokens` when given (as vLLM counts).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

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
    """Where and as whom requests go. `completions_url` is `base_url + "/completions"`."""

    base_url: str
    model: str
    api_key: str | None = None

    @property
    def completions_url(self) -> str:
        return self.base_url.rstrip("/") + "/completions"

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


async def send_completion(http: httpx.AsyncClient, endpoint: Endpoint, request: BenchRequest) -> RequestResult:
    """Send one request and time its stream; failures are results with `error` set, never raised."""
    result = RequestResult(input_len=request.input_len)
    start = time.perf_counter()
    try:
        async with http.stream("POST", endpoint.completions_url, json=completion_body(endpoint, request),
                               headers=endpoint.headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:500]}"
                return result
            await _read_stream(response, start, result)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def _read_stream(response: httpx.Response, start: float, result: RequestResult) -> None:
    last = start
    num_chunks = 0
    usage_tokens: int | None = None
    async for line in response.aiter_lines():
        payload = line.removeprefix("data:").strip() if line.startswith("data:") else ""
        if not payload:
            continue
        if payload == "[DONE]":
            break
        data = json.loads(payload)
        if "error" in data:
            result.error = f"stream error: {json.dumps(data['error'])[:500]}"
            return
        now = time.perf_counter()
        if data.get("choices"):
            if num_chunks == 0:
                result.ttft_s = now - start
            else:
                result.itl_s.append(now - last)
            last = now
            num_chunks += 1
        elif usage := data.get("usage"):
            usage_tokens = int(usage["completion_tokens"])
            result.input_len = int(usage.get("prompt_tokens", result.input_len))
    if num_chunks == 0:
        result.error = "the stream ended without any output chunk"
        return
    result.success = True
    result.latency_s = last - start
    result.output_len = usage_tokens if usage_tokens is not None else num_chunks
