"""A deliberately leaky OpenAI-compatible server: the canary must catch it.

Every `leak_every`-th generation request is answered with another tenant's earlier prompt,
lower-cased and with its dashes turned into spaces (a re-tokenized form), and streamed three
characters per chunk (so the marker is split across chunks). Every other request is answered
with its own prompt. It keeps the ground truth: which response (by its x-request-id) carried
which other tenant's prompt. Oversized prompts (more words than MAX_MODEL_LEN) get a 400, a key
it was not given a 401 (unless it is built without keys: then it has no tenants). The canary's
prefix probe (one token each, before the run) is answered plainly and neither leaks nor is
leaked: the leaks to catch are the marker run's.

`leak_in` picks the one field a leak goes into, the rest of the answer staying the request's own:
- "text": the (only) choice's text, every `leak_every`-th request, as above;
- "second_choice": a request asking for `n` > 1 gets that many choices, the second one leaking;
- "logprob_token": a request asking for logprobs gets its own text, and chosen tokens that spell
  the other tenant's prompt;
- "top_logprob": its own text and chosen tokens, and at every position a second alternative: the
  other tenant's prompt, three characters a position.
- "error": an oversized prompt's 400 quotes the other tenant's prompt in its message, after
  600 characters of its own (past what a report keeps of an error).
Those leak on every request that takes the path (once another tenant has sent one), and
never in a request that does not: a canary that never asks for `n` > 1 or logprobs, or reads only
the first choice's text, passes them.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

MODEL = "leaky-model"
MAX_MODEL_LEN = 2048
CHUNK_CHARS = 3
LEAK_FIELDS = ("text", "second_choice", "logprob_token", "top_logprob", "error")


@dataclass
class LeakLog:
    """Ground truth: server request id -> (victim key, source key)."""

    leaks: dict[str, tuple[str, str]] = field(default_factory=dict)
    last_prompt_by_key: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Answer:
    """One choice: its text, and the tokens and second alternatives its logprobs report."""

    text: str
    tokens: list[str]
    alternatives: list[str]


def build_app(leak_every: int, log: LeakLog, keys: list[str] | None, leak_in: str = "text") -> FastAPI:
    app = FastAPI()
    counter = itertools.count(1)

    @app.middleware("http")
    async def tenants_only(request: Request, call_next: Any) -> Response:
        key = request.headers.get("authorization", "").removeprefix("Bearer ")
        if keys is not None and request.url.path.startswith("/v1/") and key not in keys:
            return JSONResponse({"error": {"message": "unknown key", "type": "invalid_request_error",
                                           "code": "invalid_api_key", "param": None}}, status_code=401)
        return await call_next(request)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model",
                                                          "max_model_len": MAX_MODEL_LEN}]})

    async def generate(request: Request, is_chat: bool) -> Response:
        key = request.headers.get("authorization", "").removeprefix("Bearer ")
        body = await request.json()
        prompt = body["messages"][-1]["content"] if is_chat else body["prompt"]
        if len(prompt.split()) > MAX_MODEL_LEN:
            return _too_long(key, prompt, log, leak_in == "error", f"leaky-{next(counter)}")
        if body.get("max_tokens") == 1:  # the canary's prefix probe
            return JSONResponse({"id": "probe", "object": "x", "model": MODEL,
                                 "choices": [{"index": 0, "finish_reason": "length", "text": "x"}]})
        count = next(counter)
        server_id = f"leaky-{count}"
        with_logprobs = bool(body.get("logprobs")) if is_chat else body.get("logprobs") is not None
        num_choices = int(body.get("n") or 1) if leak_in == "second_choice" else 1
        answers = _answers(count, leak_every, leak_in, num_choices, with_logprobs, key, prompt, server_id, log)
        headers = {"x-request-id": server_id}
        if body.get("stream"):
            return StreamingResponse(_events(answers, server_id, is_chat, with_logprobs),
                                     media_type="text/event-stream", headers=headers)
        choices = [{"index": i, "finish_reason": "length", **_content(a.text, is_chat, "message"),
                    "logprobs": _logprobs(a.tokens, a.alternatives, is_chat) if with_logprobs else None}
                   for i, a in enumerate(answers)]
        return JSONResponse({"id": server_id, "object": "x", "model": MODEL, "choices": choices}, headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, is_chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, is_chat=True)

    return app


def _too_long(key: str, prompt: str, log: LeakLog, leaks: bool, server_id: str) -> Response:
    """The 400 of an oversized prompt; leaking, its message quotes another tenant's last prompt."""
    message = "too long"
    others = [(k, p) for k, p in log.last_prompt_by_key.items() if k != key]
    if leaks and others:
        source_key, source_prompt = others[-1]
        log.leaks[server_id] = (key, source_key)
        message = f"too long: {'x' * 600} such as {source_prompt.lower().replace('-', ' ')}"
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "code": "context_length_exceeded", "param": None}}, status_code=400,
                        headers={"x-request-id": server_id})


def _answers(count: int, leak_every: int, leak_in: str, num_choices: int, with_logprobs: bool, key: str,
             prompt: str, server_id: str, log: LeakLog) -> list[Answer]:
    others = [(k, p) for k, p in log.last_prompt_by_key.items() if k != key]
    log.last_prompt_by_key[key] = prompt
    own = Answer(prompt, _tokens(prompt), [])
    answers = [own] * num_choices
    asked = {"text": bool(leak_every) and count % leak_every == 0, "second_choice": num_choices > 1,
             "logprob_token": with_logprobs, "top_logprob": with_logprobs}[leak_in]
    if not (asked and others):
        return answers
    source_key, source_prompt = others[-1]
    log.leaks[server_id] = (key, source_key)
    foreign = "Sure! " + source_prompt.lower().replace("-", " ")
    if leak_in == "text":
        return [Answer(foreign, _tokens(foreign), [])]
    if leak_in == "second_choice":
        return [own, Answer(foreign, _tokens(foreign), []), *answers[2:]]
    if leak_in == "logprob_token":
        return [Answer(prompt, _tokens(foreign), [])]
    return [Answer(prompt, own.tokens, _tokens(foreign))]


def _tokens(text: str) -> list[str]:
    return [text[i:i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)]


def _content(text: str, is_chat: bool, part: str) -> dict[str, Any]:
    return {part: {"role": "assistant", "content": text}} if is_chat else {"text": text}


def _logprobs(tokens: list[str], alternatives: list[str], is_chat: bool) -> dict[str, Any]:
    """Each position's token at -0.1 and, where there is one, a second alternative at -2.5."""
    tops = [[(t, -0.1)] + ([(alternatives[i], -2.5)] if i < len(alternatives) else []) for i, t in enumerate(tokens)]
    if is_chat:
        return {"content": [{"token": t, "logprob": -0.1, "bytes": list(t.encode()),
                             "top_logprobs": [{"token": a, "logprob": v, "bytes": list(a.encode())} for a, v in top]}
                            for t, top in zip(tokens, tops, strict=True)]}
    return {"tokens": tokens, "token_logprobs": [-0.1] * len(tokens), "top_logprobs": [dict(top) for top in tops]}


def _events(answers: list[Answer], server_id: str, is_chat: bool, with_logprobs: bool) -> Iterator[bytes]:
    """Three characters a chunk, choices interleaved; with logprobs, one token's entry a chunk."""
    for i in range(max(max(len(_tokens(a.text)), len(a.tokens)) for a in answers)):
        choices = []
        for index, a in enumerate(answers):
            piece = a.text[i * CHUNK_CHARS:(i + 1) * CHUNK_CHARS]
            tokens, alternatives = a.tokens[i:i + 1], a.alternatives[i:i + 1]
            if piece or tokens:
                choices.append({"index": index, **_content(piece, is_chat, "delta"),
                                "logprobs": _logprobs(tokens, alternatives, is_chat) if with_logprobs else None})
        yield b"data: " + json.dumps({"id": server_id, "choices": choices}).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


class LeakyServer:
    """Runs the app with uvicorn on 127.0.0.1 in a thread of the test process."""

    def __init__(self, port: int, leak_every: int, keys: list[str] | None, leak_in: str = "text") -> None:
        """`keys` None: any key is taken (a server without tenants); `leak_in`: one of LEAK_FIELDS."""
        assert leak_in in LEAK_FIELDS, leak_in
        self.log = LeakLog()
        self.port = port
        config = uvicorn.Config(build_app(leak_every, self.log, keys, leak_in), host="127.0.0.1", port=port,
                                log_level="warning")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LeakyServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise AssertionError("the leaky test server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
