"""`kvseal bench serve`'s stream reader against a loopback server that frames events unevenly:
split across writes, several in one write, CRLF line ends, comments; and its failure results."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable

from aiohttp import web

from kvseal.bench.client import Endpoint, RequestResult, send_completion
from kvseal.bench.dataset import BenchRequest
from kvseal.bench.runner import http_client

REQUEST = BenchRequest(prompt_token_ids=[1, 2, 3], output_len=3)


def chunk(text: str) -> bytes:
    return f"data: {json.dumps({'choices': [{'index': 0, 'text': text}]})}".encode()


USAGE = b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}'


def serve_writes(writes: list[bytes], status: int = 200) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        if status != 200:
            return web.json_response({"error": {"message": "bad model", "code": 404}}, status=status)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for write in writes:
            await response.write(write)
            await asyncio.sleep(0.01)  # separate reads on the client's side
        await response.write_eof()
        return response
    return handler


def send(writes: list[bytes], status: int = 200) -> RequestResult:
    async def run() -> RequestResult:
        app = web.Application()
        app.router.add_post("/v1/completions", serve_writes(writes, status))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with http_client(2, 30.0) as http:
                return await send_completion(http, Endpoint(f"http://127.0.0.1:{port}/v1", "m"), REQUEST)
        finally:
            await runner.cleanup()
    return asyncio.run(run())


def test_events_split_and_joined_across_reads() -> None:
    stream = (chunk("a") + b"\r\n\r\n" + b": keep-alive comment\n\n" + chunk("b") + b"\n\n" + chunk("c") + b"\n\n"
              + USAGE + b"\n\ndata: [DONE]\n\n")
    cut_1, cut_2 = 7, len(chunk("a")) + 3  # mid-payload, then between the CR LF pairs
    result = send([stream[:cut_1], stream[cut_1:cut_2], stream[cut_2:]])
    assert result.success, result.error
    assert result.output_len == 3 and result.input_len == 5  # the usage chunk's counts
    assert len(result.itl_s) == 2 and 0 < result.ttft_s <= result.latency_s


def test_without_usage_counts_chunks() -> None:
    result = send([chunk("a") + b"\n\n" + chunk("b") + b"\n\n"])  # no usage, no [DONE]
    assert result.success and result.output_len == 2 and result.input_len == REQUEST.input_len


def test_failures_are_results() -> None:
    refused = send([], status=404)
    assert not refused.success and refused.error.startswith("HTTP 404") and "bad model" in refused.error
    error = send([chunk("a") + b"\n\n", b'data: {"error": {"message": "engine stopped"}}\n\n'])
    assert not error.success and "engine stopped" in error.error
    empty = send([USAGE + b"\n\ndata: [DONE]\n\n"])
    assert not empty.success and "without any output chunk" in empty.error


def test_unreachable_server_is_a_result() -> None:
    async def run() -> RequestResult:
        async with http_client(1, 5.0) as http:
            return await send_completion(http, Endpoint("http://127.0.0.1:9/v1", "m"), REQUEST)
    result = asyncio.run(run())
    assert not result.success and "Connect" in result.error
