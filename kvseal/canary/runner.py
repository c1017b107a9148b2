"""The async runner: sends the plan with bounded concurrency and records what came back.

Every request ends in exactly one `Outcome`. Nothing is retried: a status is evidence as it
is. Streams are read chunk by chunk and joined, so a marker split across chunks is still
found; a planned abort closes the connection after its chunk count.

What came back is kept by the field it came in (`ResponseFields`): every choice's text and
every other string of its message (reasoning, tool calls), its logprob tokens joined (and chat's
token bytes), its top alternatives and vLLM's prompt_logprobs read rank by rank (the k-th
alternative of every position, joined) and kept by position for the search in any rank order,
and an error's body (`error`: a refusal, or an error event in a stream), so a marker is found
wherever a leak put it and the report can say where.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from kvseal.canary.plan import TOOL_NAME, Endpoint, PlannedRequest, echo_prefill, record_code_tool

REQUEST_ID_HEADER = "x-request-id"
MAX_ERROR_CHARS = 65_536  # of an error body, read for markers

Positions = tuple[tuple[str, ...], ...]  # per token position, every text it offers (chosen and alternatives)


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
    positions: dict[str, Positions] = dataclasses.field(default_factory=dict)  # alternatives, by position


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
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = req.prompt_logprobs
    if req.endpoint is Endpoint.COMPLETIONS:
        body["prompt"] = req.prompt
        if req.logprobs is not None:
            body["logprobs"] = req.logprobs
        if req.is_echo:
            body["echo"] = True
        return body
    body["messages"] = [{"role": "user", "content": req.prompt}]
    if req.logprobs is not None:
        body |= {"logprobs": True, "top_logprobs": req.logprobs}
    if req.is_echo:  # chat echoes a last message of the answer's own role: one the model continues
        body["messages"].append({"role": "assistant", "content": echo_prefill(req.marker)})
        body |= {"echo": True, "add_generation_prompt": False, "continue_final_message": True}
    if req.is_tool_call:
        body |= {"tools": [record_code_tool(req.marker.text)],
                 "tool_choice": {"type": "function", "function": {"name": TOOL_NAME}}}
    return body


@dataclass
class _Position:
    chosen: str  # "" where the field has none (prompt_logprobs: the prompt token is not marked as such)
    ranked: list[str]  # the alternatives, most likely first


class ResponseFields:
    """A response's texts by the field they came in, choice by choice, over every chunk.

    Fields are named by their JSON path: `choices[1].text`, `choices[0].message.content` (a
    stream's `delta.content`), every other string of the message or delta
    (`choices[0].message.reasoning_content`, `.reasoning`,
    `choices[0].message.tool_calls[0].function.arguments`, `.name`, ...: whatever a tool or
    reasoning parser adds, joined over a stream's chunks by the call's `index`),
    `choices[0].logprobs.tokens` / `.content[].token` / `.content[].bytes` (the chosen tokens,
    joined; bytes decoded as UTF-8), `choices[0].logprobs.top_logprobs` /
    `.content[].top_logprobs[].token` / `.content[].top_logprobs[].bytes` (one text per rank:
    the k-th most likely alternative of every position, joined), and vLLM's
    `prompt_logprobs[].decoded_token` (chat) / `choices[0].prompt_logprobs[].decoded_token`
    (completions), read as alternatives by rank. Every field of alternatives is also kept by
    position (`positions`), for the search in any rank order."""

    def __init__(self, endpoint: Endpoint) -> None:
        self._endpoint = endpoint
        self._texts: dict[str, list[str]] = {}
        self._bytes: dict[str, bytearray] = {}
        self._tops: dict[str, list[_Position]] = {}  # field -> its positions

    def add_response(self, payload: dict[str, Any]) -> str:
        """Take a whole response or one stream event; returns its new content text."""
        if payload.get("prompt_logprobs"):  # chat: one list for the response
            self._add_prompt_logprobs("prompt_logprobs", payload["prompt_logprobs"])
        return "".join([self.add_choice(c) for c in payload.get("choices") or []])

    def add_choice(self, choice: dict[str, Any]) -> str:
        """Take one choice (or a stream chunk's piece of it); returns its new content text."""
        i = int(choice.get("index") or 0)
        if choice.get("prompt_logprobs"):  # completions: one list a choice
            self._add_prompt_logprobs(f"choices[{i}].prompt_logprobs", choice["prompt_logprobs"])
        if self._endpoint is Endpoint.COMPLETIONS:
            return self._add_completion(i, choice)
        part = "message" if "message" in choice else "delta"
        message = choice.get(part) or {}
        text = str(message.get("content") or "")
        self._add_strings(f"choices[{i}].{part}", message)
        self._add_chat_logprobs(i, (choice.get("logprobs") or {}).get("content") or [])
        return text

    def add_error(self, raw: str) -> None:
        """An error's whole body (to `MAX_ERROR_CHARS`), as the field `error`: a refusal or an
        error event is a path a leak could take too (a message quoting another tenant's prompt),
        and `error_text` keeps only its start for the report."""
        self._add("error", raw[:MAX_ERROR_CHARS])

    def add_raw(self, field: str, raw: str) -> None:
        self._add(field, raw)

    def _add_completion(self, i: int, choice: dict[str, Any]) -> str:
        logprobs = choice.get("logprobs") or {}
        text = str(choice.get("text") or "")
        self._add(f"choices[{i}].text", text)
        tokens = [str(t) for t in logprobs.get("tokens") or []]
        self._add(f"choices[{i}].logprobs.tokens", "".join(tokens))
        for k, top in enumerate(logprobs.get("top_logprobs") or []):
            ranked = sorted(top.items(), key=lambda kv: -float(kv[1])) if isinstance(top, dict) else []
            chosen = tokens[k] if k < len(tokens) else ""
            self._add_position(f"choices[{i}].logprobs.top_logprobs", chosen, [str(t) for t, _ in ranked])
        return text

    def _add_chat_logprobs(self, i: int, entries: list[dict[str, Any]]) -> None:
        path = f"choices[{i}].logprobs.content[]"
        self._add(f"{path}.token", "".join(str(e.get("token") or "") for e in entries))
        for e in entries:
            self._bytes.setdefault(f"{path}.bytes", bytearray()).extend(_token_bytes(e))
            tops = e.get("top_logprobs") or []
            self._add_position(f"{path}.top_logprobs[].token", str(e.get("token") or ""),
                               [str(t.get("token") or "") for t in tops])
            self._add_position(f"{path}.top_logprobs[].bytes", _decoded(_token_bytes(e)),
                               [_decoded(_token_bytes(t)) for t in tops])

    def _add_prompt_logprobs(self, path: str, positions: list[Any]) -> None:
        """vLLM's shape: per prompt token None or {token id: {"logprob", "rank", "decoded_token"}}."""
        for entries in positions:
            values = [v for v in entries.values() if isinstance(v, dict)] if isinstance(entries, dict) else []
            ranked = sorted(values, key=_rank)
            self._add_position(f"{path}[].decoded_token", "", [str(v.get("decoded_token") or "") for v in ranked])

    def _add_strings(self, path: str, value: Any) -> None:
        """Every string under `value`, by its path; a list item with an `index` (a streamed tool
        call's delta) is named by it, so its pieces join over chunks."""
        if isinstance(value, str):
            self._add(path, value)
        elif isinstance(value, dict):
            for key, item in value.items():
                if key != "role":
                    self._add_strings(f"{path}.{key}", item)
        elif isinstance(value, list):
            for k, item in enumerate(value):
                index = item.get("index") if isinstance(item, dict) else None
                self._add_strings(f"{path}{key_of(index, k)}", item)

    def _add(self, field: str, text: str) -> None:
        if text:
            self._texts.setdefault(field, []).append(text)

    def _add_position(self, field: str, chosen: str, ranked: list[str]) -> None:
        self._tops.setdefault(field, []).append(_Position(chosen, ranked))

    def texts(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, tuple[str, ...]] = {field: ("".join(pieces),) for field, pieces in self._texts.items()}
        out |= {field: (_decoded(bytes(raw)),) for field, raw in self._bytes.items() if raw}
        for field, positions in self._tops.items():
            ranks = max((len(p.ranked) for p in positions), default=0)
            by_rank = tuple("".join(p.ranked[k] for p in positions if len(p.ranked) > k) for k in range(ranks))
            if any(by_rank):
                out[field] = by_rank
        return out

    def positions(self) -> dict[str, Positions]:
        """Each field of alternatives by position: the chosen text (where there is one) and every
        alternative."""
        return {field: tuple(tuple(([p.chosen] if p.chosen else []) + p.ranked) for p in positions)
                for field, positions in self._tops.items() if any(p.ranked for p in positions)}


def key_of(index: Any, position: int) -> str:
    """A list item's name in a field path: `[index]` where the item names it, else its position."""
    return f"[{index}]" if isinstance(index, int) else f"[{position}]"


def _rank(entry: dict[str, Any]) -> int:
    """A prompt_logprobs entry's rank; one without a number after every ranked one."""
    rank = entry.get("rank")
    return rank if isinstance(rank, int) else 1 << 62


def _token_bytes(entry: dict[str, Any]) -> bytes:
    raw = entry.get("bytes")
    if not isinstance(raw, list):
        return b""
    return bytes(b for b in raw if isinstance(b, int) and 0 <= b < 256)


def _decoded(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace")


async def _send(client: httpx.AsyncClient, target: Target, req: PlannedRequest) -> RequestResult:
    started = time.monotonic()
    headers = {"authorization": f"Bearer {target.keys[req.key_index]}"}
    body = request_body(req, target.model)
    fields = ResponseFields(req.endpoint)
    try:
        if req.is_stream:
            outcome, status, server_id, error = await _stream(client, req, body, headers, fields)
        else:
            outcome, status, server_id, error = await _unary(client, req, body, headers, fields)
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"
        outcome, status, server_id = Outcome.TRANSPORT_ERROR, None, None
    return RequestResult(req, outcome, status, fields.texts(), server_id, error, time.monotonic() - started,
                         fields.positions())


_Answer = tuple[Outcome, int | None, str | None, str | None]  # outcome, status, server id, error


async def _unary(client: httpx.AsyncClient, req: PlannedRequest, body: dict[str, Any],
                 headers: dict[str, str], fields: ResponseFields) -> _Answer:
    resp = await client.post(req.endpoint.path, json=body, headers=headers)
    server_id = resp.headers.get(REQUEST_ID_HEADER)
    if resp.status_code >= 300:
        fields.add_error(resp.text)
        return _status_outcome(resp.status_code), resp.status_code, server_id, error_text(resp.text)
    try:
        payload = resp.json()
        fields.add_response(payload)
    except (ValueError, AttributeError, TypeError) as exc:
        fields.add_raw("body", resp.text)
        return Outcome.INCOMPLETE, resp.status_code, server_id, f"unparseable body: {exc}"
    return Outcome.OK, resp.status_code, server_id or payload.get("id"), None


async def _stream(client: httpx.AsyncClient, req: PlannedRequest, body: dict[str, Any],
                  headers: dict[str, str], fields: ResponseFields) -> _Answer:
    async with client.stream("POST", req.endpoint.path, json=body, headers=headers) as resp:
        server_id = resp.headers.get(REQUEST_ID_HEADER)
        if resp.status_code >= 300:
            raw = (await resp.aread()).decode(errors="replace")
            fields.add_error(raw)
            return _status_outcome(resp.status_code), resp.status_code, server_id, error_text(raw)
        num_chunks = 0
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return Outcome.OK, resp.status_code, server_id, None
            try:
                event = json.loads(data)
            except ValueError:
                return Outcome.INCOMPLETE, resp.status_code, server_id, f"unparseable event: {data[:200]}"
            if "error" in event:
                fields.add_error(data)
                return Outcome.SERVER_ERROR, resp.status_code, server_id, error_text(data)
            server_id = server_id or event.get("id")
            num_chunks += bool(fields.add_response(event))
            if req.abort_after_chunks is not None and num_chunks >= req.abort_after_chunks:
                return Outcome.ABORTED, resp.status_code, server_id, None
        return Outcome.INCOMPLETE, resp.status_code, server_id, "stream ended without [DONE]"


def _status_outcome(status: int) -> Outcome:
    return Outcome.SERVER_ERROR if status >= 500 else Outcome.REJECTED


def error_text(raw: str) -> str:
    """`code: message` from an OpenAI-format error body, else the raw text (shortened)."""
    try:
        err = json.loads(raw)["error"]
        return f"{err.get('code') or err.get('type')}: {err.get('message')}"[:500]
    except (ValueError, KeyError, TypeError, AttributeError):
        return raw[:500]
