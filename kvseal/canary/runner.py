"""The async runner: sends the plan with bounded concurrency and records what came back.

Every request ends in exactly one `Outcome`. Nothing is retried: a status is evidence as it
is. Streams are read chunk by chunk and joined, so a marker split across chunks is still
found; a planned abort closes the connection after its chunk count.

What came back is kept by the field it came in (`ResponseFields`): every choice's text, its
logprob tokens joined, and its top alternatives read rank by rank (the k-th alternative of
every position, joined), and an error's body (`error`: a refusal, or an error event in a
stream), so a marker is found wherever a leak put it and the report can say where.
"""

from __future__ import annotations

import asyncio
import enum
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from kvseal.canary.plan import Endpoint, PlannedRequest

REQUEST_ID_HEADER = "x-request-id"


class Outcome(enum.Enum):
    OK = "ok"  # 2xx, complete
    ABORTED = "aborted"  # the canary dropped the stream as planned
    REJECTED = "rejected"  # 4xx
    SERVER_ERROR = "server_error"  # 5xx, or an error event inside a 2xx stream
    INCOMPLETE = "incomplete"  # a 2xx stream that ended without [DONE]
    TRANSPORT_ERROR = "transport_error"  # no HTTP answer: refused, reset, timed out


@dataclass(frozen=True)
class RequestResult:
    request: PlannedRequest
    outcome: Outcome
    status: int | None
    fields: dict[str, tuple[str, ...]]  # field path -> its texts (joined stream chunks), see ResponseFields
    server_request_id: str | None
    error: str | None
    duration_s: float


@dataclass(frozen=True)
class Target:
    root_url: str
    model: str
    keys: tuple[str, ...]
    timeout_s: float


async def run_plan(plan: list[PlannedRequest], target: Target, concurrency: int,
                   on_result: Callable[[RequestResult], None]) -> list[RequestResult]:
    """Run every planned request, at most `concurrency` at a time; results in plan order."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(target.timeout_s, connect=min(30.0, target.timeout_s))
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=target.root_url, limits=limits, timeout=timeout) as client:
        async def one(req: PlannedRequest) -> RequestResult:
            async with gate:
                result = await _send(client, target, req)
            on_result(result)
            return result

        return list(await asyncio.gather(*(one(r) for r in plan)))


def request_body(req: PlannedRequest, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": req.max_tokens, "temperature": 0, "stream": req.is_stream}
    if req.n > 1:
        body["n"] = req.n
    if req.endpoint is Endpoint.COMPLETIONS:
        body["prompt"] = req.prompt
        if req.logprobs is not None:
            body["logprobs"] = req.logprobs
    else:
        body["messages"] = [{"role": "user", "content": req.prompt}]
        if req.logprobs is not None:
            body |= {"logprobs": True, "top_logprobs": req.logprobs}
    return body


class ResponseFields:
    """A response's texts by the field they came in, choice by choice, over every chunk.

    Fields are named by their JSON path: `choices[1].text`, `choices[0].message.content` (a
    stream's `delta.content`), `choices[0].logprobs.tokens` / `.content[].token` (the chosen
    tokens, joined), `choices[0].logprobs.top_logprobs` / `.content[].top_logprobs[].token`
    (one text per rank: the k-th most likely alternative of every position, joined)."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint
        self._texts: dict[str, list[str]] = {}
        self._tops: dict[str, list[list[str]]] = {}  # field -> per position, alternatives by rank

    def add_choice(self, choice: dict[str, Any]) -> str:
        """Take one choice (or a stream chunk's piece of it); returns its new content text."""
        i = int(choice.get("index") or 0)
        logprobs = choice.get("logprobs") or {}
        if self._endpoint is Endpoint.COMPLETIONS:
            text = str(choice.get("text") or "")
            self._add(f"choices[{i}].text", text)
            self._add(f"choices[{i}].logprobs.tokens", "".join(str(t) for t in logprobs.get("tokens") or []))
            for top in logprobs.get("top_logprobs") or []:
                ranked = sorted(top.items(), key=lambda kv: -float(kv[1])) if isinstance(top, dict) else []
                self._tops.setdefault(f"choices[{i}].logprobs.top_logprobs", []).append([str(t) for t, _ in ranked])
            return text
        part = "message" if "message" in choice else "delta"
        text = str((choice.get(part) or {}).get("content") or "")
        self._add(f"choices[{i}].{part}.content", text)
        entries = logprobs.get("content") or []
        self._add(f"choices[{i}].logprobs.content[].token", "".join(str(e.get("token") or "") for e in entries))
        for e in entries:
            tops = [str(t.get("token") or "") for t in e.get("top_logprobs") or []]
            self._tops.setdefault(f"choices[{i}].logprobs.content[].top_logprobs[].token", []).append(tops)
        return text

    def _add(self, field: str, text: str) -> None:
        if text:
            self._texts.setdefault(field, []).append(text)

    def texts(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, tuple[str, ...]] = {field: ("".join(pieces),) for field, pieces in self._texts.items()}
        for field, positions in self._tops.items():
            ranks = max((len(p) for p in positions), default=0)
            by_rank = tuple("".join(p[k] for p in positions if len(p) > k) for k in range(ranks))
            if any(by_rank):
                out[field] = by_rank
        return out


async def _send(client: httpx.AsyncClient, target: Target, req: PlannedRequest) -> RequestResult:
    started = time.monotonic()
    headers = {"authorization": f"Bearer {target.keys[req.key_index]}"}
    body = request_body(req, target.model)
    try:
        if req.is_stream:
            outcome, status, fields, server_id, error = await _stream(client, req, body, headers)
        else:
            outcome, status, fields, server_id, error = await _unary(client, req, body, headers)
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
        outcome, status, fields, server_id = Outcome.TRANSPORT_ERROR, None, {}, None
    return RequestResult(req, outcome, status, fields, server_id, error, time.monotonic() - started)


MAX_ERROR_CHARS = 65_536  # of an error body, read for markers

_Answer = tuple[Outcome, int | None, dict[str, tuple[str, ...]], str | None, str | None]


async def _unary(client: httpx.AsyncClient, req: PlannedRequest, body: dict[str, Any],
                 headers: dict[str, str]) -> _Answer:
    resp = await client.post(req.endpoint.path, json=body, headers=headers)
    server_id = resp.headers.get(REQUEST_ID_HEADER)
    if resp.status_code >= 300:
        return _status_outcome(resp.status_code), resp.status_code, _error_field(resp.text), server_id, \
            error_text(resp.text)
    fields = ResponseFields(req.endpoint)
    try:
        payload = resp.json()
        for choice in payload.get("choices", []):
            fields.add_choice(choice)
    except (ValueError, AttributeError, TypeError) as exc:
        return Outcome.INCOMPLETE, resp.status_code, {"body": (resp.text,)}, server_id, f"unparseable body: {exc}"
    return Outcome.OK, resp.status_code, fields.texts(), server_id or payload.get("id"), None


async def _stream(client: httpx.AsyncClient, req: PlannedRequest, body: dict[str, Any],
                  headers: dict[str, str]) -> _Answer:
    async with client.stream("POST", req.endpoint.path, json=body, headers=headers) as resp:
        server_id = resp.headers.get(REQUEST_ID_HEADER)
        if resp.status_code >= 300:
            raw = (await resp.aread()).decode(errors="replace")
            return _status_outcome(resp.status_code), resp.status_code, _error_field(raw), server_id, error_text(raw)
        fields = ResponseFields(req.endpoint)
        num_chunks = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return Outcome.OK, resp.status_code, fields.texts(), server_id, None
            try:
                event = json.loads(data)
            except ValueError:
                bad = f"unparseable event: {data[:200]}"
                return Outcome.INCOMPLETE, resp.status_code, fields.texts(), server_id, bad
            if "error" in event:
                return Outcome.SERVER_ERROR, resp.status_code, fields.texts() | _error_field(data), server_id, \
                    error_text(data)
            server_id = server_id or event.get("id")
            piece = "".join([fields.add_choice(c) for c in event.get("choices", [])])
            num_chunks += bool(piece)
            if req.abort_after_chunks is not None and num_chunks >= req.abort_after_chunks:
                return Outcome.ABORTED, resp.status_code, fields.texts(), server_id, None
        return Outcome.INCOMPLETE, resp.status_code, fields.texts(), server_id, "stream ended without [DONE]"


def _error_field(raw: str) -> dict[str, tuple[str, ...]]:
    """An error's whole body (to `MAX_ERROR_CHARS`), as the field `error`: a refusal or an error
    event is a path a leak could take too (a message quoting another tenant's prompt), and
    `error_text` keeps only its start for the report."""
    return {"error": (raw[:MAX_ERROR_CHARS],)} if raw else {}


def _status_outcome(status: int) -> Outcome:
    return Outcome.SERVER_ERROR if status >= 500 else Outcome.REJECTED


def error_text(raw: str) -> str:
    """`code: message` from an OpenAI-format error body, else the raw text (shortened)."""
    try:
        err = json.loads(raw)["error"]
        return f"{err.get('code') or err.get('type')}: {err.get('message')}"[:500]
    except (ValueError, KeyError, TypeError, AttributeError):
        return raw[:500]
