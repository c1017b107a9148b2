"""`POST /tokenize` and `POST /detokenize` in vLLM's shapes, authenticated like every route.

/tokenize takes `{"prompt": str}` (tokenized as /v1/completions does) or `{"messages": [...]}`
(rendered with the chat template as /v1/chat/completions does) and answers
`{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` only with
`return_token_strs`). /detokenize takes `{"tokens": [int]}` and answers `{"prompt": str}`.
Neither touches the engine; both run the tokenizer on the frontend's tokenizer thread.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import FastAPI
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvseal.errors import InvalidParameter, RequestRejected
from kvseal.server import errors
from kvseal.server.auth import Tenant
from kvseal.server.body import parse_body, read_body, require_json
from kvseal.server.errors import ApiError
from kvseal.server.prompts import check_token_list_before_parsing
from kvseal.server.protocol import INT32_MAX, ChatMessage, _Body
from kvseal.server.state import AppState


class TokenizeCompletionBody(_Body):
    model: str | None = None
    prompt: str
    return_token_strs: bool = False


class TokenizeChatBody(_Body):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    return_token_strs: bool = False


class DetokenizeBody(_Body):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, le=INT32_MAX)]]


def add_tokenize_routes(app: FastAPI, state: AppState) -> None:
    @app.post("/tokenize", response_model=None)
    async def tokenize(request: Request) -> Response:
        return await _answer(request, state, _tokenize)

    @app.post("/detokenize", response_model=None)
    async def detokenize(request: Request) -> Response:
        return await _answer(request, state, _detokenize)


async def _answer(request: Request, state: AppState, handler: Any) -> Response:
    try:
        tenant = state.keys.authenticate(request.headers.get("authorization"))
        require_json(request)
        data = await read_body(request, state.config.max_body_bytes, state.config.body_timeout_s)
        check_token_list_before_parsing(data, state.limits)
        return JSONResponse(await handler(data, state, tenant))
    except ApiError as err:
        return errors.response(err)
    except RequestRejected as exc:
        return errors.response(errors.from_rejected(exc))


async def _tokenize(data: bytes, state: AppState, tenant: Tenant) -> dict[str, Any]:
    """A prompt that cannot fit the context is refused before tokenizing, as on the generation
    routes: tokenizing it would only let one tenant stall the tokenizer for every other."""
    body = _tokenize_body(data)
    _check_model(body.model, state)
    if isinstance(body, TokenizeChatBody):
        ids = await state.prompts.chat_ids([m.as_template_input() for m in body.messages], tenant.name,
                                           state.limits, may_truncate=False)
    else:
        ids = await state.prompts.completion_ids(body.prompt, tenant.name, state.limits, may_truncate=False)
    token_strs = state.prompts.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.engine_info.max_model_len, "tokens": ids,
            "token_strs": token_strs}


def _tokenize_body(data: bytes) -> TokenizeCompletionBody | TokenizeChatBody:
    """The chat shape when the body has `messages`, the prompt shape otherwise."""
    try:
        raw = json.loads(data)
    except ValueError:
        raw = None  # parse_body below reports the JSON error in the usual shape
    if isinstance(raw, dict) and "messages" in raw:
        return parse_body(TokenizeChatBody, data)
    return parse_body(TokenizeCompletionBody, data)


async def _detokenize(data: bytes, state: AppState, tenant: Tenant) -> dict[str, Any]:
    body = parse_body(DetokenizeBody, data)
    _check_model(body.model, state)
    vocab_size = state.engine_info.vocab_size
    bad = next((t for t in body.tokens if t >= vocab_size), None)
    if bad is not None:
        raise InvalidParameter(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param="tokens")
    return {"prompt": await state.prompts.decode(body.tokens, tenant.name)}


def _check_model(model: str | None, state: AppState) -> None:
    if model is not None and model != state.model_name:
        raise errors.model_not_found(model, state.model_name)
