"""A deliberately leaky OpenAI-compatible server: the canary must catch it.

Every `leak_every`-th generation request is answered with another tenant's earlier prompt,
lower-cased and with its dashes turned into spaces (a re-tokenized form), and streamed three
characters per chunk (so the marker is split across chunks). Every other request is answered
with its own prompt. It keeps the ground truth: which response (by its x-request-id) carried
which other tenant's prompt. Oversized prompts (more words than MAX_MODEL_LEN) get a 400, a key
it was not given a 401 (unless it is built without keys: then it has no tenants). The canary's
prefix probe (one token each, before the run) is answered plainly and neither leaks nor is
leaked: the leaks to catch are the marker run's.
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


@dataclass
class LeakLog:
    """Ground truth: server request id -> (victim key, source key)."""

    leaks: dict[str, tuple[str, str]] = field(default_factory=dict)
    last_prompt_by_key: dict[str, str] = field(default_factory=dict)


def build_app(leak_every: int, log: LeakLog, keys: list[str] | None) -> FastAPI:
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
            return JSONResponse({"error": {"message": "too long", "type": "invalid_request_error",
                                           "code": "context_length_exceeded", "param": None}}, status_code=400)
        if body.get("max_tokens") == 1:  # the canary's prefix probe
            return JSONResponse({"id": "probe", "object": "x", "model": MODEL,
                                 "choices": [{"index": 0, "finish_reason": "length", "text": "x"}]})
        n = next(counter)
        server_id = f"leaky-{n}"
        text = _answer(n, leak_every, key, prompt, server_id, log)
        headers = {"x-request-id": server_id}
        if body.get("stream"):
            return StreamingResponse(_events(text, server_id, is_chat), media_type="text/event-stream",
                                     headers=headers)
        choice = {"index": 0, "finish_reason": "length",
                  **({"message": {"role": "assistant", "content": text}} if is_chat else {"text": text})}
        return JSONResponse({"id": server_id, "object": "x", "model": MODEL, "choices": [choice]}, headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, is_chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, is_chat=True)

    return app


def _answer(n: int, leak_every: int, key: str, prompt: str, server_id: str, log: LeakLog) -> str:
    others = [(k, p) for k, p in log.last_prompt_by_key.items() if k != key]
    log.last_prompt_by_key[key] = prompt
    if leak_every and n % leak_every == 0 and others:
        source_key, source_prompt = others[-1]
        log.leaks[server_id] = (key, source_key)
        return "Sure! " + source_prompt.lower().replace("-", " ")
    return prompt


def _events(text: str, server_id: str, is_chat: bool) -> Iterator[bytes]:
    for i in range(0, len(text), CHUNK_CHARS):
        piece = text[i:i + CHUNK_CHARS]
        choice = {"index": 0, **({"delta": {"content": piece}} if is_chat else {"text": piece})}
        yield b"data: " + json.dumps({"id": server_id, "choices": [choice]}).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


class LeakyServer:
    """Runs the app with uvicorn on 127.0.0.1 in a thread of the test process."""

    def __init__(self, port: int, leak_every: int, keys: list[str] | None) -> None:
        """`keys` None: any key is taken (a server without tenants)."""
        self.log = LeakLog()
        self.port = port
        config = uvicorn.Config(build_app(leak_every, self.log, keys), host="127.0.0.1", port=port,
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
