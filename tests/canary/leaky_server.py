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
  600 characters of its own (past what a report keeps of an error);
- "logprob_bytes": a chat request asking for logprobs gets its own text and tokens, whose
  `bytes` spell the other tenant's prompt;
- "top_logprob_shuffled": its own text and tokens, and at every position two alternatives, the
  other tenant's prompt (three characters a position) at rank 1 or 2 by turns, so no rank read
  alone holds more than three of its characters in a row;
- "prompt_logprobs": a request asking for vLLM's prompt_logprobs gets them for its own prompt,
  with the other tenant's prompt as every position's second alternative;
- "echo": a request asking for echo gets the other tenant's prompt where its own should be
  echoed (chat: the last message), then its own answer;
- "reasoning": every chat answer carries `reasoning_content` (as with a reasoning parser):
  the other tenant's prompt;
- "tool_call": every chat answer carries a tool call (as with a tool-call parser) whose
  arguments quote the other tenant's prompt.
Those leak on every request that takes the path (once another tenant has sent one), and
never in a request that does not: a canary that never asks for `n` > 1, logprobs,
prompt_logprobs or echo, or reads only the first choice's text, passes them.
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
LEAK_FIELDS = ("text", "second_choice", "logprob_token", "top_logprob", "error", "logprob_bytes",
               "top_logprob_shuffled", "prompt_logprobs", "echo", "reasoning", "tool_call")
FILLER_ALTERNATIVE = "the"  # vowels: never part of a marker


@dataclass
class LeakLog:
    """Ground truth: server request id -> (victim key, source key)."""

    leaks: dict[str, tuple[str, str]] = field(default_factory=dict)
    last_prompt_by_key: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Answer:
    """One choice: its text, the tokens and alternatives (per position, by rank) its logprobs
    report, the texts whose bytes chat's logprobs give for its tokens (None: the tokens' own),
    and what a reasoning or tool-call parser would have split off ("": nothing)."""

    text: str
    tokens: list[str]
    alternatives: list[list[str]]
    token_bytes: list[str] | None = None
    reasoning: str = ""
    tool_arguments: str = ""


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
        if is_chat and body.get("echo"):  # the user's prompt is the one before the continued message
            prompt = body["messages"][0]["content"]
        count = next(counter)
        server_id = f"leaky-{count}"
        with_logprobs = bool(body.get("logprobs")) if is_chat else body.get("logprobs") is not None
        num_choices = int(body.get("n") or 1) if leak_in == "second_choice" else 1
        path = Path(is_chat, with_logprobs, body.get("prompt_logprobs") is not None, bool(body.get("echo")))
        others = [(k, p) for k, p in log.last_prompt_by_key.items() if k != key]
        answers = _answers(count, leak_every, leak_in, num_choices, path, key, prompt, server_id, log)
        headers = {"x-request-id": server_id}
        if body.get("stream"):
            return StreamingResponse(_events(answers, server_id, is_chat, with_logprobs),
                                     media_type="text/event-stream", headers=headers)
        choices = [{"index": i, "finish_reason": "length", **_content(a, is_chat, "message"),
                    "logprobs": _logprobs(a, is_chat) if with_logprobs else None}
                   for i, a in enumerate(answers)]
        payload = {"id": server_id, "object": "x", "model": MODEL, "choices": choices}
        if path.prompt_logprobs:
            source = _foreign(others[-1][1]) if leak_in == "prompt_logprobs" and others else ""
            listed = _prompt_logprobs(prompt, source)
            if is_chat:
                payload["prompt_logprobs"] = listed
            else:
                for choice in choices:
                    choice["prompt_logprobs"] = listed
        return JSONResponse(payload, headers=headers)

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


@dataclass(frozen=True)
class Path:
    """What a request asked for, which decides the paths a leak may take."""

    is_chat: bool
    with_logprobs: bool
    prompt_logprobs: bool
    echo: bool


def _answers(count: int, leak_every: int, leak_in: str, num_choices: int, path: Path, key: str,
             prompt: str, server_id: str, log: LeakLog) -> list[Answer]:
    others = [(k, p) for k, p in log.last_prompt_by_key.items() if k != key]
    log.last_prompt_by_key[key] = prompt
    own = Answer(prompt, _tokens(prompt), [])
    answers = [own] * num_choices
    asked = {"text": bool(leak_every) and count % leak_every == 0, "second_choice": num_choices > 1,
             "logprob_token": path.with_logprobs, "top_logprob": path.with_logprobs, "error": False,
             "logprob_bytes": path.with_logprobs and path.is_chat, "top_logprob_shuffled": path.with_logprobs,
             "prompt_logprobs": path.prompt_logprobs, "echo": path.echo, "reasoning": path.is_chat,
             "tool_call": path.is_chat}[leak_in]
    if not (asked and others):
        return answers
    source_key, source_prompt = others[-1]
    log.leaks[server_id] = (key, source_key)
    return _leaking(leak_in, own, _foreign(source_prompt), answers)


def _leaking(leak_in: str, own: Answer, foreign: str, answers: list[Answer]) -> list[Answer]:
    """The answers with the foreign text in the mode's one field."""
    if leak_in == "text":
        return [Answer(foreign, _tokens(foreign), [])]
    if leak_in == "second_choice":
        return [own, Answer(foreign, _tokens(foreign), []), *answers[2:]]
    if leak_in == "logprob_token":
        return [Answer(own.text, _tokens(foreign), [])]
    if leak_in == "top_logprob":
        return [Answer(own.text, own.tokens, [[piece] for piece in _tokens(foreign)])]
    if leak_in == "top_logprob_shuffled":
        return [Answer(own.text, own.tokens, [[piece, FILLER_ALTERNATIVE] if i % 2 else [FILLER_ALTERNATIVE, piece]
                                              for i, piece in enumerate(_tokens(foreign))])]
    if leak_in == "logprob_bytes":
        return [Answer(own.text, own.tokens, [], token_bytes=_tokens(foreign))]
    if leak_in == "echo":
        return [Answer(foreign + " " + own.text, _tokens(foreign + " " + own.text), [])]
    if leak_in == "reasoning":
        return [Answer(own.text, own.tokens, [], reasoning=foreign)]
    if leak_in == "tool_call":
        return [Answer(own.text, own.tokens, [], tool_arguments=json.dumps({"note": foreign}))]
    return answers  # prompt_logprobs: the answers are the request's own; the list is not (generate)


def _foreign(source_prompt: str) -> str:
    return "Sure! " + source_prompt.lower().replace("-", " ")


def _tokens(text: str) -> list[str]:
    return [text[i:i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)]


def _content(a: Answer, is_chat: bool, part: str) -> dict[str, Any]:
    if not is_chat:
        return {"text": a.text}
    message: dict[str, Any] = {"role": "assistant", "content": a.text}
    if a.reasoning:
        message["reasoning_content"] = a.reasoning
    if a.tool_arguments:
        call = {"id": "call-0", "type": "function", "function": {"name": "note", "arguments": a.tool_arguments}}
        message["tool_calls"] = [call | {"index": 0} if part == "delta" else call]
    return {part: message}


def _logprobs(a: Answer, is_chat: bool) -> dict[str, Any]:
    """Each position's token at -0.1, then its alternatives from -2.5 down."""
    tops = [[(t, -0.1)] + [(alt, -2.5 - rank) for rank, alt in enumerate(a.alternatives[i] if i < len(a.alternatives)
                                                                        else [])]
            for i, t in enumerate(a.tokens)]
    if is_chat:
        spelled = a.token_bytes or a.tokens
        return {"content": [{"token": t, "logprob": -0.1,
                             "bytes": list(spelled[i].encode()) if i < len(spelled) else [],
                             "top_logprobs": [{"token": alt, "logprob": v, "bytes": list(alt.encode())}
                                              for alt, v in top]}
                            for i, (t, top) in enumerate(zip(a.tokens, tops, strict=True))]}
    return {"tokens": a.tokens, "token_logprobs": [-0.1] * len(a.tokens), "top_logprobs": [dict(top) for top in tops]}


def _prompt_logprobs(prompt: str, foreign: str) -> list[dict[str, Any] | None]:
    """vLLM's shape over the prompt's three-character tokens (None for the first); with `foreign`,
    every position's second alternative is its next three characters."""
    alternatives = _tokens(foreign)
    out: list[dict[str, Any] | None] = [None]
    for i, token in enumerate(_tokens(prompt)[1:]):
        position = {str(1000 + i): {"logprob": -0.1, "rank": 1, "decoded_token": token}}
        if i < len(alternatives):
            position[str(2000 + i)] = {"logprob": -2.5, "rank": 2, "decoded_token": alternatives[i]}
        out.append(position)
    return out


def _events(answers: list[Answer], server_id: str, is_chat: bool, with_logprobs: bool) -> Iterator[bytes]:
    """Three characters a chunk, choices interleaved; with logprobs, one token's entry a chunk; a
    reasoning or tool call text three characters a chunk after the content."""
    for i in range(max(max(len(_tokens(a.text)), len(a.tokens)) for a in answers)):
        choices = []
        for index, a in enumerate(answers):
            piece = a.text[i * CHUNK_CHARS:(i + 1) * CHUNK_CHARS]
            token_bytes = a.token_bytes[i:i + 1] if a.token_bytes is not None else None
            part = Answer(piece, a.tokens[i:i + 1], a.alternatives[i:i + 1], token_bytes)
            if piece or part.tokens:
                choices.append({"index": index, **_content(part, is_chat, "delta"),
                                "logprobs": _logprobs(part, is_chat) if with_logprobs else None})
        yield b"data: " + json.dumps({"id": server_id, "choices": choices}).encode() + b"\n\n"
    for index, a in enumerate(answers):
        for piece in _tokens(a.reasoning):
            yield _event(server_id, index, Answer("", [], [], reasoning=piece))
        for piece in _tokens(a.tool_arguments):
            yield _event(server_id, index, Answer("", [], [], tool_arguments=piece))
    yield b"data: [DONE]\n\n"


def _event(server_id: str, index: int, part: Answer) -> bytes:
    choice = {"index": index, **_content(part, True, "delta"), "logprobs": None}
    return b"data: " + json.dumps({"id": server_id, "choices": [choice]}).encode() + b"\n\n"


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
